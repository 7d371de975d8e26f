"""``python -m nanovllm_core.speculative.cli``: generate with speculative decoding and measure what it bought.

Runs the prompts twice in one process on the same loaded target: without speculation, then
with the chosen draft. Prints the completions, the draft's acceptance counters, the expected
tokens per verification from the measured acceptance rate (Leviathan et al. 2023, eq. 1),
and the measured speed-up. Bad arguments end with exit status 2 and one line on stderr.

Example::

    python -m nanovllm_core.speculative.cli --draft-model self:20 --prompt "The future of AI is" \\
        --num-speculative-tokens 5
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from nanovllm_core.cli_args import (
    QUANTIZATION_CHOICES,
    count_int,
    load_progress,
    model_name,
    positive_int,
    prompt_text,
    quantization_name,
    sampling_decimal,
    seed_int,
)
from nanovllm_core.educational.commentary import plural

DEFAULT_PROMPT = "The future of AI is"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command's options (``--target-model``, ``--draft-model``, ``--num-speculative-tokens``, ...)."""
    p = _Parser(prog="nanovllm-spec",
                description="Speculative decoding with the nano-vLLM engine, compared with plain decoding.")
    p.add_argument("--target-model", type=model_name, default=None,
                   help="repo id, folder or .gguf of the target (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", type=model_name, default=None,
                   help="'self:N' (the target's first N layers), 'ngram' (prompt lookup), 'target', or a draft "
                        "model's repo id/folder/.gguf with the target's tokenizer (default: the embedded model)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=5, help="draft tokens per step, k (default 5)")
    p.add_argument("--prompt", action="append", default=None, type=prompt_text,
                   help=f"a prompt (repeatable; default {DEFAULT_PROMPT!r})")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="tokens per prompt (default 48)")
    p.add_argument("--temperature", type=sampling_decimal("temperature"), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=count_int(0), default=0)
    p.add_argument("--top-p", type=sampling_decimal("top_p"), default=1.0)
    p.add_argument("--seed", type=seed_int, default=None, help="per-request random seed")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens even past end-of-sequence")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None, type=quantization_name,
                   help="the target's weights, as nanovllm's --quantization (default auto: the embedded model's "
                        "Q4_1 blocks on the CPU; none: float32)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block (default 16; 256 on a GPU where flash-attn runs)")
    p.add_argument("--num-kv-blocks", type=positive_int, default=None,
                   help="KV pool size in blocks (default: enough for the prompts)")
    return p


@dataclass
class TimedRun:
    """One timed ``generate``: the outputs, wall seconds, generated tokens, engine steps it took, the engine's stats."""

    outputs: list
    seconds: float
    num_tokens: int
    steps: int
    stats: dict

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.seconds, 1e-9)


def timed_generate(llm, prompts: list, params) -> TimedRun:
    """Generate and time it (seconds of wall clock, including scheduling and drafting)."""
    steps_before = llm.stats()["steps"]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, reject_bad_prompts=True)  # a bad prompt is reported, not raised
    seconds = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    stats = llm.stats()
    return TimedRun(outputs, seconds, num_tokens, stats["steps"] - steps_before, stats)


def default_draft(target: str | None) -> str:
    """The draft when none is named: the embedded model (the target itself when that is the target too)."""
    return "target" if target is None else "default"


def pool_blocks(num_tokens: list[int], max_tokens: int, k: int, block_size: int) -> int:
    """KV blocks enough for every prompt at once, with room for its output and k draft slots."""
    return sum(-(-(n + max_tokens + k + 1) // block_size) for n in num_tokens) + 2


def speculation_report(stats: dict, k: int) -> list[str]:
    """Lines describing the acceptance counters and the expected tokens per verification."""
    from nanovllm_core.speculative.metrics import expected_accepted_length

    rate, alpha = stats["spec_acceptance_rate"], stats["spec_per_token_acceptance_rate"]
    if not stats["spec_verifications"]:
        return ["  no verification ran: the proposer drafted nothing for these prompts (an n-gram "
                "proposer needs the text to repeat an earlier stretch of itself)"]
    return [
        f"  draft tokens: {stats['spec_draft_tokens']}, accepted: {stats['spec_accepted_tokens']} "
        f"(acceptance rate {rate:.1%}) over {stats['spec_verifications']} verifications",
        f"  per-token acceptance rate alpha (accepted / drafts judged up to the first rejection): {alpha:.3f}",
        f"  tokens per verification: measured {stats['spec_mean_accepted_length']:.2f}; "
        f"expected E = (1 - a^(k+1)) / (1 - a) with k={k}: {expected_accepted_length(alpha, k):.2f} for a = alpha, "
        f"{expected_accepted_length(rate, k):.2f} for a = acceptance rate",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the prompts without and with speculation; print completions, acceptance and speed-up. Returns 0,
    or 1 (one line on stderr) when a request ended with an error.

    Raises:
        SystemExit: status 2 with one line on stderr for bad arguments, a model that cannot
            be loaded, or a draft that does not fit the target.
    """
    from nanovllm_core.host_load import HostCheck

    host = HostCheck()  # the load before anything is timed; busy_host reads it again at the end
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = args.prompt or [DEFAULT_PROMPT]
    if any(p == "" for p in prompts):  # only spaces is a prompt: it tokenizes to tokens, as vLLM takes it
        parser.error("--prompt must not be empty")
    draft = args.draft_model or default_draft(args.target_model)
    from nanovllm_core.attention.selector import default_block_size
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_core.llm import LLM, close_progress
    from nanovllm_core.model.loader import ModelLoadError, load_model
    from nanovllm_core.sampling_params import SamplingParams

    progress = load_progress("nanovllm-spec")
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        base_cfg = EngineConfig(model=args.target_model, device=args.device, dtype=args.dtype,
                                block_size=args.block_size)
        EngineConfig(speculative_model=draft, num_speculative_tokens=args.num_speculative_tokens)  # check early
        model, tokenizer, resolved = load_model(args.target_model, base_cfg.torch_device, base_cfg.torch_dtype,
                                                progress=progress, quantization=args.quantization)
    except (ModelLoadError, ValueError) as e:
        close_progress(progress)  # the error line starts on a line of its own, not on a half-drawn bar
        parser.error(str(e))
    if args.chat and not getattr(tokenizer, "chat_template", None):
        parser.error("this model's tokenizer has no chat template; drop --chat")
    inputs = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False)
              if args.chat else p for p in prompts]
    lengths = [len(x) if isinstance(x, list) else len(tokenizer.encode(x)) for x in inputs]
    base_cfg.block_size = args.block_size or default_block_size(base_cfg.torch_device, base_cfg.torch_dtype,
                                                                model.config.head_dim)
    blocks = args.num_kv_blocks or pool_blocks(lengths, args.max_tokens, args.num_speculative_tokens,
                                               base_cfg.block_size)
    try:
        plain = LLM.from_engine(LLMEngine(EngineConfig(**{**vars(base_cfg), "num_kv_blocks": blocks}),
                                          model, tokenizer, resolved))
        spec = LLM.from_engine(LLMEngine(EngineConfig(**{**vars(base_cfg), "num_kv_blocks": blocks,
                                                         "speculative_model": draft,
                                                         "num_speculative_tokens": args.num_speculative_tokens}),
                                         model, tokenizer, resolved))
    except (ModelLoadError, ValueError) as e:
        parser.error(str(e))
    plain.generate(inputs[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   reject_bad_prompts=True)  # warm up (a bad first prompt is reported with the others below)
    try:
        base = timed_generate(plain, inputs, params)
        fast = timed_generate(spec, inputs, params)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130

    for prompt, out, ref in zip(prompts, fast.outputs, base.outputs):
        c = out.outputs[0]
        print(f"Prompt: {prompt!r}")
        if c.finish_reason == "rejected":
            print(f"  rejected: {out.error}\n")
            continue
        print(f"Completion: {c.text!r}")
        same = c.token_ids == ref.outputs[0].token_ids
        note = "identical to the run without speculation" if same else "differs from the run without speculation"
        if not same and not params.greedy:
            note += " (expected when sampling: same distribution, other random draws)"
        print(f"  [{plural(len(c.token_ids), 'token')}, finish_reason={c.finish_reason}; {note}]\n")
    k = args.num_speculative_tokens
    weights = spec.engine.model_info()["weight_format"]
    print(f"Speculative decoding with draft {draft!r}, k={k}, target {spec.engine.model_name} "
          f"({spec.engine.model.quantization or 'float'} weights: {weights}):")
    for line in speculation_report(fast.stats, k):
        print(line)
    print(f"  engine steps (target forward passes): {fast.steps} with speculation, {base.steps} without")
    print(f"  speed: {fast.tokens_per_s:.1f} tokens/s with speculation ({plural(fast.num_tokens, 'token')} in {fast.seconds:.2f} s), "
          f"{base.tokens_per_s:.1f} tokens/s without ({base.num_tokens} in {base.seconds:.2f} s): "
          f"speed-up {fast.tokens_per_s / max(base.tokens_per_s, 1e-9):.2f}x")
    if fast.tokens_per_s < base.tokens_per_s:
        print("  " + slower_note(draft, k, fast.steps, base.steps, spec=fast, plain=base))
    busy = busy_host(host)
    if busy:
        print(f"  {busy}")
    from nanovllm_core.outputs import error_summary

    for run, outputs in (("with speculation", fast.outputs), ("without speculation", base.outputs)):
        failed = error_summary(outputs)
        if failed is not None:  # cut short: say why once, and fail the command (as nanovllm does)
            print(f"nanovllm-spec: error: {failed} ({run})", file=sys.stderr, flush=True)
            return 1
    return 0


def busy_host(host=None) -> str | None:
    """The busy-host note every benchmark prints (``nanovllm_core.host_load``: a 1-minute load average above
    the cores when ``host``, a ``HostCheck`` made at the start, was made, or now), with what it means here:
    the speed-up is a wall-clock ratio; the step and acceptance counts are not. None on a quiet host."""
    from nanovllm_core.host_load import busy_host_note, load_average, own_threads

    note = host.note() if host is not None else busy_host_note(None, load_average(), own=own_threads())
    if note is None:
        return None
    return f"{note}; the speed-up is a wall-clock ratio and follows the load, the step and acceptance counts do not"


def slower_note(draft: str, k: int, steps_spec: int, steps_plain: int, spec: TimedRun | None = None,
                plain: TimedRun | None = None) -> str:
    """Why speculation was slower than plain decoding in a run, and what tends to pay off (one line).

    ``spec``/``plain``: the two timed runs, for the draft tokens per verification and each run's
    wall time per engine step.
    """
    saved = steps_plain - steps_spec
    stats = spec.stats if spec is not None else {}
    verifications = stats.get("spec_verifications") or 0
    if draft == "ngram":
        if verifications:
            rows = 1 + stats.get("spec_draft_tokens", 0) / verifications
            cost = f"each verification ran the model on {rows:.1f} tokens on average instead of 1"
        else:
            cost = f"each verification ran the model on up to {k + 1} tokens instead of 1"
    elif draft.startswith("self:"):
        cost = f"each step also ran {draft[5:]} of the model's layers {plural(k, 'time')} to draft"
    else:
        cost = f"each step also ran the draft model {plural(k, 'time')}"
    if spec is not None and plain is not None and spec.steps and plain.steps:
        per_spec, per_plain = spec.seconds / spec.steps, plain.seconds / plain.steps
        cost += (f"; a step took {per_spec * 1e3:,.0f} ms on average against {per_plain * 1e3:,.0f} ms without "
                 f"speculation (wall time / steps, {per_spec / max(per_plain, 1e-12):.1f}x)")
    advice = "speculation pays where a pass over a few tokens costs little more than a pass over one"
    if draft != "ngram":
        advice += "; n-gram lookup ('--draft-model ngram') drafts with no model pass, on text that repeats its prompt"
    advice += "; a smaller --num-speculative-tokens wastes less"
    return f"drafting cost more than it saved here: {saved} of {steps_plain} target passes saved, but {cost}; {advice}"


if __name__ == "__main__":
    sys.exit(main())

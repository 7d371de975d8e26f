"""Speculative decoding on the CPU with the default model: tokens/s with and without, and why.

For each proposer setting the same greedy prompts run twice in this process on the same
loaded target (without speculation, then with it) and the table shows:

- tokens/s of both runs and their ratio (the speed-up; machines differ, ratios travel better);
- the measured acceptance rate (accepted / drafted), the per-token rate alpha (accepted /
  drafts judged up to the first rejection), the measured tokens per verification, and the
  value the formula E = (1 - alpha^(k+1)) / (1 - alpha) predicts from alpha (Leviathan et al. 2023).

Settings: ``self:N`` (the target's first N of 30 layers drafting) at a few N and k,
``target`` (the target as its own draft: every draft accepted, but drafting costs as much as
verifying), and ``ngram`` (prompt lookup) on a prompt that repeats itself. Not a test:
nothing is asserted.

    python benchmarks/benchmark_speculative.py            # the full table (a few minutes on 2 cores)
    python benchmarks/benchmark_speculative.py --quick    # two settings, short outputs (smoke run)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.common, when run as a script
from benchmarks.common import HostCheck, check_json_path, write_json  # noqa: E402
from nanovllm_core.config import EngineConfig  # noqa: E402
from nanovllm_core.engine.llm_engine import LLMEngine  # noqa: E402
from nanovllm_core.llm import LLM  # noqa: E402
from nanovllm_core.model.loader import load_model  # noqa: E402
from nanovllm_core.sampling_params import SamplingParams  # noqa: E402
from nanovllm_core.speculative.cli import pool_blocks, timed_generate  # noqa: E402
from nanovllm_core.speculative.metrics import expected_accepted_length  # noqa: E402

PROSE = [
    "The future of AI is",
    "Once upon a time, in a small village by the sea,",
]
# Prompt lookup shines when the output copies its context.
REPEATING = [
    "Repeat the list exactly three times.\nList: red apple, green pear, yellow banana, purple grape, orange mango.\n"
    "1. red apple, green pear, yellow banana, purple grape, orange mango.\n2.",
]
FULL = [("self:8", 3, PROSE), ("self:20", 3, PROSE), ("self:26", 1, PROSE), ("self:26", 3, PROSE),
        ("self:28", 3, PROSE), ("self:28", 5, PROSE), ("target", 3, PROSE),
        ("ngram", 3, REPEATING), ("ngram", 5, REPEATING), ("ngram", 8, REPEATING)]
QUICK = [("self:26", 2, PROSE[:1]), ("ngram", 3, REPEATING)]


@dataclass
class Row:
    """One setting's figures (tokens/s, ratios, acceptance)."""

    proposer: str
    k: int
    workload: str
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    acceptance_rate: float
    alpha: float
    mean_accepted_length: float
    expected_length: float
    steps_plain: int
    steps_spec: int
    identical: bool


def measure(model, tokenizer, resolved, proposer: str, k: int, prompts: list[str], max_tokens: int) -> Row:
    """Run ``prompts`` greedily without and with speculation on the same model; return the figures."""
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    blocks = pool_blocks(lengths, max_tokens, k, 16)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=blocks), model, tokenizer, resolved))
    spec = LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=blocks, speculative_model=proposer,
                                                  num_speculative_tokens=k), model, tokenizer, resolved))
    base = timed_generate(plain, prompts, params)
    fast = timed_generate(spec, prompts, params)
    s = fast.stats
    alpha = s["spec_per_token_acceptance_rate"]
    return Row(
        proposer=proposer, k=k, workload="repeating" if prompts[0] in REPEATING else "prose",
        plain_tokens_per_s=base.tokens_per_s, spec_tokens_per_s=fast.tokens_per_s,
        speedup=fast.tokens_per_s / max(base.tokens_per_s, 1e-9), acceptance_rate=s["spec_acceptance_rate"],
        alpha=alpha, mean_accepted_length=s["spec_mean_accepted_length"],
        expected_length=expected_accepted_length(alpha, k), steps_plain=base.steps, steps_spec=fast.steps,
        identical=[o.outputs[0].token_ids for o in fast.outputs] == [o.outputs[0].token_ids for o in base.outputs],
    )


def print_table(rows: list[Row]) -> None:
    print(f"{'proposer':<9} {'k':>2} {'workload':<10} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} "
          f"{'acc rate':>8} {'alpha':>6} {'len':>5} {'E(alpha)':>8} {'steps':>9} {'same':>5}")
    for r in rows:
        print(f"{r.proposer:<9} {r.k:>2} {r.workload:<10} {r.plain_tokens_per_s:>11.1f} {r.spec_tokens_per_s:>10.1f} "
              f"{r.speedup:>7.2f}x {r.acceptance_rate:>8.1%} {r.alpha:>6.2f} {r.mean_accepted_length:>5.2f} "
              f"{r.expected_length:>8.2f} {r.steps_spec:>4}/{r.steps_plain:<4} {'yes' if r.identical else 'NO':>5}")
    print("acc rate: drafts accepted / drafts proposed; alpha: drafts accepted / drafts judged (a draft after the "
          "first rejection is never judged), the per-token rate E(alpha) assumes; len: measured tokens per "
          "verification; E(alpha): (1 - alpha^(k+1)) / (1 - alpha); steps: engine steps with/without speculation; "
          "same: greedy tokens identical")


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two settings, 8 tokens: a smoke run")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 48, quick 8)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    args = p.parse_args(argv)
    check_json_path(p, args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = QUICK if args.quick else FULL
    max_tokens = args.max_tokens or (8 if args.quick else 48)
    host = HostCheck()
    model, tokenizer, resolved = load_model(None, torch.device("cpu"), torch.float32)
    warm = LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=8), model, tokenizer, resolved))
    warm.generate(PROSE[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    print(f"speculative decoding, {resolved.name}, cpu float32, {torch.get_num_threads()} threads, "
          f"greedy, {max_tokens} tokens per prompt", flush=True)
    rows = []
    for proposer, k, prompts in settings:
        rows.append(measure(model, tokenizer, resolved, proposer, k, prompts, max_tokens))
        print(f"  measured {proposer} k={k}", file=sys.stderr, flush=True)
    print_table(rows)
    host.report()
    write_json(args.json, [asdict(r) for r in rows])
    return rows


if __name__ == "__main__":
    main()

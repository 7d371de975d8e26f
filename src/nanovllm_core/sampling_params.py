"""``SamplingParams``: how one request chooses its tokens and when it stops.

Field names and meanings are vLLM's (``vllm.SamplingParams``), so a script moves between the
two by changing an import. Every value is checked at construction: a bad one raises
``ValueError`` naming the field and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm_core.prompts import unicode_problem
from nanovllm_core.untrusted import shown

_GREEDY_EPS = 1e-5
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # torch.Generator.manual_seed's signed 64-bit range (vLLM's limit too)
# Counts (n, top_k, max_tokens, min_tokens) fit a signed 32-bit integer, so every tensor and C kernel takes
# them; anything larger could never be served anyway (no context holds 2**31 tokens).
COUNT_MAX = 2**31 - 1
# Byte counts (kv_cache_memory, the server's --max-body-bytes) are not counts of things: a GPU's free memory
# is far above 2**31, so their bound is 64 bits.
BYTES_MAX = 2**63 - 1
# A request's priority, at every entry point (LLM.generate, LLMEngine.add_request, the CLI's --priority,
# the server's "priority", the app's prompt bar): -1000 to 1000 is plenty of levels, and the app's
# request table shows each in full. vLLM takes any integer; here a value outside is refused, not clipped.
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000


def _shown(value: object) -> str:
    """``value`` quoted for an error message on one line: its ``repr`` of at most 40 characters, or its
    start and its size (``untrusted.shown``: a 900 KB text is not quoted whole)."""
    return shown(value).replace("\n", "\\n")


def check_int(name: str, value: object, low: int, high: int, hint: str = "") -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``; the shared check of every
    integer request field (``priority`` at each entry point, and the counts above).

    Args:
        name: the field as the caller spells it (``"priority"``, ``"--priority"``).
        hint: what the value means or what to do, added after the range (e.g. "higher runs first").

    Raises:
        ValueError: one line naming the field, the value, the range and what to pass instead.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number from {low} to {high}, got {_shown(value)}"
                         f"{'; ' + hint if hint else ''}")
    return value


FCFS_FIX = "use scheduling_policy='priority' or priority 0"  # check_priority's default advice (the library's names)


def check_priority(value: object, name: str = "priority", policy: str | None = None, fix: str = FCFS_FIX) -> int:
    """``value`` if it is a valid request priority (an int in ``[PRIORITY_MIN, PRIORITY_MAX]``), and
    under ``policy="fcfs"`` 0 only: requests then run in arrival order, and vLLM refuses any other
    priority there ("Got priority 1 but Priority scheduling is not enabled"); here it was accepted and
    ignored (trial 12). The one rule of every entry point: ``LLMEngine.check_priority`` (the engine's own
    policy) for the library, the server and the controller; ``nanovllm``/``nanovllm-tui --priority``
    and the app's prompt bar with the policy they start or talk to. ``policy`` None: the range only
    (the policy is not known yet). ``fix``: what to do, in the caller's own option names.

    Raises:
        ValueError: one line naming ``name``, the range and which way priority runs, or the policy and ``fix``.
    """
    check_int(name, value, PRIORITY_MIN, PRIORITY_MAX,
              "higher runs first (vLLM's priority is the opposite); pass a value in that range")
    if policy == "fcfs" and value != 0:
        raise ValueError(f"{name} is {value}, but the engine schedules fcfs (arrival order, priorities unused; "
                         f"vLLM refuses a priority other than 0 there too); {fix}")
    return value


OVERFLOW_FIX = "lower max_tokens or raise max_model_len"  # max_tokens_overflow's default advice
# ... and where max_model_len is already the model's whole context, raising it is refused (trial 20e)
OVERFLOW_FIX_FULL = "lower max_tokens (max_model_len is already the model's whole context)"


def max_tokens_overflow(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                        option: str = "max_tokens", prompt: str = "the prompt has",
                        fix: str = OVERFLOW_FIX, model_context: int | None = None,
                        fix_full: str = OVERFLOW_FIX_FULL) -> str | None:
    """Why ``max_tokens`` does not fit after a prompt of ``num_prompt_tokens`` tokens in a context of
    ``max_model_len`` tokens (vLLM's server rule: prompt + max_tokens <= max_model_len), as one line;
    None when it fits, when ``max_tokens`` is None (up to the context), or when the prompt alone fills
    the context (a refusal of its own: ``LLMEngine.request_problem``).

    The one wording of this refusal, shared by ``nanovllm --max-tokens`` (``option="--max-tokens"``)
    and the engine's opt-in check (``LLMEngine.add_request(fit_context=True)``, what ``nanovllm-tui``
    sends with). ``prompt``: how the prompt is named (``"prompt 2 has"``); ``fix``: what to do;
    ``fix_full`` instead where ``max_model_len`` is already ``model_context`` (the model's
    ``max_position_embeddings``, None: not known), since raising it further is refused at load.
    """
    if max_tokens is None or not num_prompt_tokens < max_model_len < num_prompt_tokens + max_tokens:
        return None
    tokens = f"{num_prompt_tokens} token{'s' if num_prompt_tokens != 1 else ''}"
    return (f"{option} {max_tokens} does not fit: {prompt} {tokens} and the context (max_model_len) is {max_model_len}, "
            f"so at most {max_model_len - num_prompt_tokens} can follow; "
            f"{fix_full if model_context is not None and max_model_len >= model_context else fix}")


def overflow_with_options(reason: str, option: str = "--max-tokens",
                          fix: str = "lower --max-tokens or raise --max-model-len",
                          fix_full: str = "lower --max-tokens (--max-model-len is already the model's whole context)") -> str:
    """An engine refusal worded by :func:`max_tokens_overflow`'s defaults (``max_tokens ... does not fit:
    ...; lower max_tokens or raise max_model_len``) reworded for a command line: ``option`` in place of
    ``max_tokens`` and ``fix`` (``fix_full`` for :data:`OVERFLOW_FIX_FULL`) as the advice (what
    ``nanovllm-tui`` says when a ``--prompt`` given at start is refused, as ``nanovllm`` words it).
    Any other reason comes back unchanged.
    """
    if not (reason.startswith("max_tokens ") and " does not fit: " in reason):
        return reason
    for engine_fix, ours in ((OVERFLOW_FIX, fix), (OVERFLOW_FIX_FULL, fix_full)):
        if reason.endswith(engine_fix):
            return f"{option} {reason[len('max_tokens '):-len(engine_fix)]}{ours}"
    return reason


def pool_with_options(reason: str) -> str:
    """An engine refusal for a KV pool too small (``LLMEngine``'s check at add time) reworded for a command
    line, as :func:`overflow_with_options` does for the context: the options, not the fields (``nanovllm`` and
    ``nanovllm-tui`` alike). Any other
    reason comes back unchanged."""
    return (reason.replace("raise num_kv_blocks (--num-kv-blocks) or lower max_tokens",
                           "raise --num-kv-blocks or lower --max-tokens")
            .replace("shorten the prompt or raise num_kv_blocks (--num-kv-blocks)",
                     "shorten the prompt or raise --num-kv-blocks"))


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: the sampler's logits are float32
PENALTY_MIN, PENALTY_MAX = 1e-30, 1e30  # repetition_penalty's range: logits divided or multiplied by it stay finite
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's documented range for a logit_bias value: [-100, 100]


def clamped_logit_bias(bias: object) -> dict[int, float] | None:
    """``bias`` checked and each value clamped to [-100, 100] (OpenAI's range; vLLM clamps the same way):
    None for None or an empty map, else a new ``{token_id: bias}`` dict.

    Raises:
        ValueError: not a dict, a key that is not an integer >= 0, or a value that is not a finite number.
    """
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias={_shown(bias)} is invalid: must be a map of token id to bias "
                         "(e.g. {50256: -100}) or None (JSON null)")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"SamplingParams.logit_bias has the key {_shown(token)}: keys are token ids (integers >= 0)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
            raise ValueError(f"SamplingParams.logit_bias has the bias {_shown(value)} for token {token}: a bias must be "
                             f"a finite number (clamped to [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}])")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out or None


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    Attributes:
        n: samples to generate from one prompt (they share the prompt's cached blocks).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: keep the smallest set of most likely tokens whose probability sum reaches p (0 < p <= 1).
        top_k: keep the k most likely tokens; 0 or -1 turns it off.
        min_p: drop tokens whose probability is below ``min_p`` x the top token's (0 <= min_p <= 1).
        repetition_penalty: >1 discourages tokens seen in prompt or output (positive logits
            divided, negative multiplied), as in Keskar et al. 2019 (CTRL); from 1e-30 to 1e30, so
            float32 logits divided or multiplied by it stay finite. ``temperature``: at most float32's largest.
        presence_penalty: subtracted once from the logit of every token already generated.
        frequency_penalty: subtracted per occurrence of a token already generated.
        seed: a per-request random generator; the same seed gives the same tokens whatever else runs.
            A 64-bit signed integer (-2**63 .. 2**63 - 1, vLLM's range), so every torch generator takes it.
        max_tokens: the most tokens to generate (>= 1); generation also ends when the sequence
            reaches ``max_model_len`` (``finish_reason="length"``), so a larger value is not an error here
            (vLLM's ``LLM`` does the same; the server, ``nanovllm`` and ``nanovllm-tui`` refuse it, see
            :func:`max_tokens_overflow`).
        min_tokens: EOS and stop tokens are suppressed until this many tokens are generated.
        stop: strings that end generation; the text ends before the stop string unless
            ``include_stop_str_in_output``; ``stop_reason`` is the string found.
        stop_token_ids: token ids that end generation; the id stays in the output token ids,
            its text is left out unless ``include_stop_str_in_output``; ``stop_reason`` is the id.
        ignore_eos: keep generating past the end-of-sequence token.
        include_stop_str_in_output: keep the stop string (or stop token's text) in the output text.
        logprobs: per generated token, the log-probabilities of this many most likely tokens
            (0 to 20) plus the chosen one's, with ranks, under the model's raw distribution.
        skip_special_tokens: leave special tokens out of the decoded text.
        logit_bias: ``{token_id: bias}`` added to the model's logits before sampling, greedy included
            (vLLM's and OpenAI's field): each bias is clamped to [-100, 100] as OpenAI documents (+100
            all but forces a token, -100 all but bans it); ids must be integers >= 0 inside the
            vocabulary (the engine checks that: ``LLMEngine.request_problem``). Applied after the
            ``min_tokens`` ban and before the penalties, vLLM V1's order. ``logprobs`` stay those of the
            raw, unbiased logits, as vLLM returns them by default (``logprobs_mode="raw_logprobs"``).

    Integer fields take ints, never bools; the flags take bools only; the counts (``n``, ``top_k``, ``max_tokens``,
    ``min_tokens``) are at most ``COUNT_MAX`` (2**31 - 1).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        # The two list fields are checked for their type before they are copied: list(5) would raise a
        # TypeError, and list("abc") would split a string into characters.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is not None and not isinstance(self.stop, (list, tuple, set, frozenset)):
            raise ValueError(f"SamplingParams.stop={_shown(self.stop)} is invalid: "
                             "must be a string, a list of strings, or None (JSON null)")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"SamplingParams.stop_token_ids={_shown(self.stop_token_ids)} is invalid: "
                             "must be a list of token ids (integers >= 0) or None (JSON null)")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = clamped_logit_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={_shown(getattr(self, name))} is invalid: {rule}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "must be a number")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):  # "no" would be truthy: a flag is true or false
                raise bad(name, "must be true or false")
        def is_int(value: object, low: int, high: int = COUNT_MAX) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

        if not is_int(self.n, 1):
            raise bad("n", f"must be an integer from 1 to {COUNT_MAX}")
        if not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.temperature > FLOAT32_MAX:  # the logits are float32: a larger one is inf there
            raise bad("temperature", f"must be at most {FLOAT32_MAX:.3g}, float32's largest (the sampler's logits are float32)")
        if not (0 < self.top_p <= 1):
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k, -1):
            raise bad("top_k", f"must be -1 or 0 (off) or a positive integer up to {COUNT_MAX}")
        if not (0 <= self.min_p <= 1):
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0 (1 means off)")
        if not PENALTY_MIN <= self.repetition_penalty <= PENALTY_MAX:
            # > 0 in float64 was not enough: 1e-300 is 0 in float32, and logits divided by it are inf/NaN, every
            # token then read as id 0 (trial 31b); within these bounds any logit up to 1e8 stays finite
            raise bad("repetition_penalty", f"must be from {PENALTY_MIN:g} to {PENALTY_MAX:g}, so the float32 logits "
                      "it divides or multiplies stay finite (1 means off)")
        if not (-2 <= self.presence_penalty <= 2):
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not (-2 <= self.frequency_penalty <= 2):
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and not is_int(self.max_tokens, 1):
            raise bad("max_tokens", f"must be an integer from 1 to {COUNT_MAX} (or None, JSON null, for up to max_model_len)")
        if not is_int(self.min_tokens, 0):
            raise bad("min_tokens", f"must be an integer from 0 to {COUNT_MAX}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop contains {_shown(s)}: every stop must be a non-empty string")
            problem = unicode_problem(s)
            if problem is not None:  # it could never match a decoded text (trial 10)
                raise ValueError(f"SamplingParams.stop contains a string that is not valid Unicode: {problem}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids contains {_shown(t)}: token ids are integers >= 0")
        if self.logprobs is not None and not is_int(self.logprobs, 0, 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits) or None (JSON null)")

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


# vLLM's SamplingParams fields that this engine does not implement: name -> (why, what to do; "" for
# "leave it out"). The server's table (entrypoints/protocol.py, VLLM_UNSUPPORTED) takes the shared ones from
# here, so a field is refused for the same reason in Python and over HTTP.
VLLM_SAMPLING_UNSUPPORTED: dict[str, tuple[str, str]] = {
    "best_of": ("no best-of ranking: the n samples come back as drawn", "leave it out (n sets how many samples)"),
    "prompt_logprobs": ("no logprobs of the prompt's own tokens",
                        "leave it out (logprobs gives the generated tokens' logprobs)"),
    "allowed_token_ids": ("the sampler takes no allow-list of tokens",
                          "leave it out (logit_bias -100 keeps single tokens out)"),
    "bad_words": ("the sampler takes no list of banned words",
                  "leave it out (logit_bias -100 keeps single tokens out)"),
    "logits_processors": ("no custom logits processors", ""),
    "truncate_prompt_tokens": ("prompts are never cut; one longer than the context is refused",
                               "leave it out and shorten the prompt"),
    "spaces_between_special_tokens": ("the text is decoded the one way the engine does", ""),
    "detokenize": ("every output is decoded to text (stop strings and the outputs' text need it)", ""),
    "output_kind": ("LLM.generate returns each request's final output only", ""),
    **{name: ("no structured output: the text is whatever the model writes", "")
       for name in ("guided_decoding", "structured_outputs")},
    "extra_args": ("no extensions", ""),
}


class SamplingParamsKeywordError(TypeError, ValueError):
    """An unknown ``SamplingParams`` keyword: a TypeError, as Python and vLLM raise for one (code written for
    vLLM catches that), and a ValueError, as every other bad setting here (``LLM``'s unknown keywords too)."""


def unknown_sampling_keywords(given: object) -> str | None:
    """One line for the names in ``given`` that are not ``SamplingParams`` fields, or None: a vLLM field
    absent here says so, why and what to do (:data:`VLLM_SAMPLING_UNSUPPORTED`); another name gets the
    nearest field by spelling (``difflib``) and the list of every field, as ``LLM(...)`` does."""
    import difflib

    valid = sorted(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(given) - set(valid))
    if not unknown:
        return None
    parts = []
    for name in (n for n in unknown if n in VLLM_SAMPLING_UNSUPPORTED):
        why, todo = VLLM_SAMPLING_UNSUPPORTED[name]
        parts.append(f"SamplingParams' {name} (vLLM's) is not supported here ({why}); {todo or 'leave it out'}")
    others = [n for n in unknown if n not in VLLM_SAMPLING_UNSUPPORTED]
    if others:
        hints = []
        for name in others:
            near = " or ".join(difflib.get_close_matches(name, valid, n=2, cutoff=0.6))
            if near:
                hints.append(f"did you mean {near}?" if len(others) == 1 else f"{name}: did you mean {near}?")
        hint = f" ({'; '.join(hints)})" if hints else ""
        parts.append(f"unknown SamplingParams option{'s' if len(others) > 1 else ''} {', '.join(others)}{hint}; "
                     f"SamplingParams takes {', '.join(valid)} (help(SamplingParams) says what each does)")
    return "; ".join(parts)


def _checked_init(init):
    """Wrap the dataclass's ``__init__`` so an unknown keyword is :class:`SamplingParamsKeywordError` with
    :func:`unknown_sampling_keywords`' line, not Python's bare "unexpected keyword argument" (trial 21c)."""
    import functools

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        unknown = unknown_sampling_keywords(kwargs)
        if unknown:
            raise SamplingParamsKeywordError(unknown)
        init(self, *args, **kwargs)
    return __init__


SamplingParams.__init__ = _checked_init(SamplingParams.__init__)


# An engine setting's rule, here because the command lines check it while parsing, before torch is imported
# (config.py imports torch); EngineConfig applies the same rule.
def contiguous_reservation(prompt_tokens: int, max_tokens: int | None, max_model_len: int | None) -> int:
    """Tokens of room the contiguous baseline (``paged=False``) reserves for a request at admission: its
    prompt plus ``max_tokens`` (absent: ``max_model_len``), capped at ``max_model_len`` (None: no cap).
    What a pre-paging server set aside per request (Kwon et al. 2023, section 3). The one rule behind
    ``Scheduler.reservation``, the narrator's reservation sum and the X-Ray's region, which restated it."""
    want = prompt_tokens + (max_tokens or max_model_len or 0)
    return min(max_model_len, want) if max_model_len is not None else want


def contiguous_conflict(paged: bool, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                        cli: bool = False) -> str | None:
    """Why a given ``max_num_seqs`` or ``max_num_batched_tokens`` cannot act with ``paged=False``, in one
    line, or None. The contiguous baseline runs one request at a time (``max_num_seqs`` 1) and runs its
    whole prompt in one step (the budget is ``max_model_len``), so any other value would be silently
    ignored (trial 22b). ``max_num_seqs=1`` is what the mode does and is taken. ``cli``: name the
    command line's flags (``--max-num-seqs``, ``--max-prefill-tokens``, ``--no-paged-attention``)
    instead of the keywords.
    """
    if paged:
        return None
    mode = "--no-paged-attention" if cli else "paged=False"
    if max_num_seqs is not None and max_num_seqs != 1:
        name = f"--max-num-seqs {max_num_seqs}" if cli else f"max_num_seqs={max_num_seqs}"
        return f"{name} has no effect with {mode}, which runs one request at a time; leave it out"
    if max_num_batched_tokens is not None:
        name = (f"--max-prefill-tokens {max_num_batched_tokens}" if cli
                else f"max_num_batched_tokens={max_num_batched_tokens}")
        return (f"{name} has no effect with {mode}, which runs one request's whole prompt in one step "
                "(its budget is max_model_len); leave it out")
    return None

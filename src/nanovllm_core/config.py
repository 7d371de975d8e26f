"""``EngineConfig``: the engine's knobs, with vLLM's names, checked once at construction;
``ModelConfig``: the architecture numbers of a LLaMA-family checkpoint.

The ground floor of the package: plain values, imported by every layer above and
importing no model, kernel or engine code itself (see the layers contract in pyproject.toml).

Why this file runs past ~400 lines: it is the ground floor's one home for settings and their
checks; every check of a setting sits beside the setting's documentation.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from nanovllm_core.sampling_params import BYTES_MAX, COUNT_MAX, SEED_MAX, SEED_MIN, contiguous_conflict
from nanovllm_core.untrusted import shown

# The quantization modes' names (model/quantization.py builds the layers each one names).
BLOCK_MODES = ("gguf", "q8_0", "q4_0", "q4_1")  # weights in GGUF blocks (model/block_quant.py)
QUANTIZATION_MODES = BLOCK_MODES
AUTO = "auto"  # the default: model.quantization.resolve_quantization decides at load
QUANTIZATION_CHOICES = (AUTO, "none", *QUANTIZATION_MODES)  # what --quantization accepts ("none": float weights)
# The answer to --quantization int8 (cli_args.INT8_REMOVED holds the same words without importing torch; a test holds
# them equal). int8 with one scale per output channel through oneDNN/fbgemm was removed: Q8_0 blocks read fewer bytes,
# run faster at batch 1 and 64 and lose less perplexity (docs/cpu-kernels.md, "int8 weights: what went and why").
INT8_REMOVED = ("quantization int8 was removed; use q8_0 (int8 weights in 32-weight blocks, each block with its "
                "own scale), which is faster and closer to float32")

class SettingError(ValueError):
    """An engine setting that does not fit this model or this machine (a KV pool larger than free memory,
    a block longer than a sequence, a context longer than the model's): the model itself is fine, and
    the message names the option to change. Apps tell it from a model that failed to load by this class."""


SCHEDULING_POLICIES = ("priority", "fcfs")
ATTENTION_BACKENDS = ("flash", "math")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
          "float": torch.float32}


def normalize_quantization(mode: str | None) -> str | None:
    """``mode`` as the engine keeps the request: None for auto (``None`` or ``"auto"``), ``"none"`` for
    float weights asked for, else the lower-case mode name.

    Auto is decided at load by ``nanovllm_core.model.quantization.resolve_quantization`` (the
    file's own blocks for a GGUF checkpoint on the CPU, else float); a model's *built* mode
    (``model.quantization``) is None for float weights (see :func:`built_quantization`).

    Raises:
        ValueError: any value not in :data:`QUANTIZATION_CHOICES`, in one line naming the choices
            (``"int8"``, a mode this engine had: :data:`INT8_REMOVED`, naming q8_0 instead).
    """
    if mode is None:
        return None
    name = str(mode).lower()
    if name == "int8":
        raise ValueError(INT8_REMOVED)
    if name not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={mode!r} is unknown; use one of {', '.join(QUANTIZATION_CHOICES)} "
                         "(auto: a GGUF file's own blocks on the CPU where they run, else float; gguf: keep a GGUF "
                         "file's own blocks; q8_0/q4_0/q4_1: quantize at load; none: float)")
    return None if name == AUTO else name


def built_quantization(mode: str | None) -> str | None:
    """A mode to build (never auto) as ``model.quantization`` keeps it: None for float (``None`` or ``"none"``).

    Raises:
        ValueError: an unknown name, or ``"auto"`` (resolve it first).
    """
    name = normalize_quantization(mode)
    if mode is not None and name is None:
        raise ValueError("quantization='auto' must be resolved before layers are built "
                         "(model.quantization.resolve_quantization)")
    return None if name == "none" else name


def explicit_quantized(mode: str | None) -> bool:
    """True when ``mode`` asks for quantized weights by name (not auto, not none)."""
    return normalize_quantization(mode) not in (None, "none")


def check_quantization(mode: str | None) -> None:
    """Accept None or a name in :data:`QUANTIZATION_CHOICES` (see :func:`normalize_quantization`).

    Raises:
        ValueError: any other value, in one line naming the choices.
    """
    normalize_quantization(mode)


_NO_VALUE = object()


def setting(name: str, value: Any = _NO_VALUE) -> str:
    """A setting named for both callers: ``"num_kv_blocks (--num-kv-blocks)"``, or with ``value``
    ``"quantization='none' (--quantization none)"``. Errors that ``LLM(...)`` and the CLI share use it, so
    each caller reads the name it typed: the ``LLM`` keyword first, the CLI flag beside it."""
    flag = "--" + name.replace("_", "-")
    if value is _NO_VALUE:
        return f"{name} ({flag})"
    return f"{name}={value!r} ({flag} {value})"


def tensor_parallel_quantization(mode: str | None, tensor_parallel_size: int) -> str | None:
    """THE one place that decides which weight formats run split over ranks: float only, for now.

    ``mode`` is already normalized (None = auto, ``"none"`` = float asked for). With N = 1 every
    mode passes; with N > 1 auto stays None and the loader's ``resolve_quantization`` turns it
    into float weights (told the rank count, it says so in ``model.quantization_note``), ``"none"``
    passes, and the block formats are refused, since their C kernels and per-block scales are
    not split yet.

    Raises:
        ValueError: a block format with N > 1, in one line.
    """
    if tensor_parallel_size is None or tensor_parallel_size <= 1 or mode in (None, "none"):
        return mode
    raise ValueError(f"{setting('quantization', mode)} does not run with tensor_parallel_size > 1 "
                     f"(--tensor-parallel-size) yet; use {setting('quantization', 'none')}")


# vLLM's LLM(...) keywords that are spelled otherwise here (docs/engine.md, "Moving to vLLM").
VLLM_SPELLINGS = {
    "speculative_config": "speculative_model= and num_speculative_tokens=",
    "gpu_memory_utilization": "kv_cache_memory= (bytes) or num_kv_blocks=",
}


@dataclass
class EngineConfig:
    """Settings of one engine.

    Attributes:
        model: what ``resolve_model`` accepts (None = the embedded default).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (None: CUDA if available); anything else is refused
            by :func:`check_device`.
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"`` (None: see :func:`default_dtype`).
        block_size: tokens per KV block (None: 256 on a CUDA GPU where flash-attn's paged
            kernel runs, which reads 256-token pages only; else 16; see
            ``attention.selector.default_block_size``).
        num_kv_blocks: size of the KV pool in blocks (None: from ``kv_cache_memory``).
        kv_cache_memory: KV pool budget in bytes, up to :data:`BYTES_MAX` (None: a share of free memory, see
            ``default_kv_cache_memory``); a budget below one KV block is refused when the block's size is known.
        max_num_seqs: most sequences running at once (None: 64; 1 with ``paged=False``, which refuses any
            other value: :func:`contiguous_conflict`).
        max_num_batched_tokens: the per-step token budget (None: 512, or ``max_model_len``
            when chunked prefill is off, since a whole prompt must then fit one step; ``max_model_len``
            with ``paged=False``, which refuses a given value: :func:`contiguous_conflict`).
        max_model_len: longest sequence, prompt + output, in tokens (None: the model's).
        scheduling_policy: ``"priority"`` (higher ``priority`` first, then arrival; the default here,
            while vLLM defaults to ``"fcfs"`` and runs lower ``priority`` values first) or ``"fcfs"``.
        enable_prefix_caching: reuse cached full blocks of equal prefixes.
        enable_chunked_prefill: split long prompts across steps within the token budget.
        paged: False runs the contiguous, one-request-at-a-time baseline.
        attention_backend: ``"flash"`` (fused kernel) or ``"math"`` (explicit score matrix).
        seed: seeds torch's global generator for unseeded sampling (None: not seeded).
        speculative_model: speculative decoding's proposer (None: off). ``"ngram"`` (prompt
            lookup), ``"self:N"`` (the target's first N layers as an early-exit draft),
            ``"target"`` (the target model itself as the draft, with its own KV pool), or a
            draft model (repo id, folder or ``.gguf``) with the target's vocabulary.
        num_speculative_tokens: draft tokens proposed per step and sequence, k (None: 5 when
            ``speculative_model`` is set).
        quantization: how the linear layers and the LM head hold their weights (see
            ``nanovllm_core.model.quantization``). None or ``"auto"`` (the default): decided at load
            by ``resolve_quantization``: a GGUF checkpoint's own blocks on the CPU when its linear
            layers are in a block format the engine runs and the block kernel builds, else float
            (``model_info()["quantization_note"]`` says why). ``"none"``: float, in ``dtype``.
            The others run on the CPU only. ``"gguf"``: a GGUF checkpoint's own blocks (Q8_0, Q4_0, Q4_1) as the
            file ships them, embedding included. ``"q8_0"``, ``"q4_0"``, ``"q4_1"``: float
            weights cut into those blocks at load (embedding and tied head in Q8_0).
            ``"int8"`` was removed (:data:`INT8_REMOVED`): ``"q8_0"`` replaces it.
        tensor_parallel_size: N processes splitting the model (Megatron's tensor parallelism,
            ``model/parallel.py``; workers in ``engine/tensor_parallel.py``): 1 (default) runs
            in this process alone. N > 1 needs the paged engine, float weights (see
            :func:`tensor_parallel_quantization`) and no speculative decoding; N must divide
            the model's heads, intermediate size and vocabulary (checked when the model's
            config is read, before any worker starts).
        tp_master_addr: the address rank 0 listens on for its workers (None: 127.0.0.1;
            ``"0.0.0.0"``: every interface); ranks on other hosts connect to it.
        tp_master_port: the port it listens on (None: a free one; required when ranks join
            from other hosts, who must be told it).
        tp_local_ranks: K: ranks 0..K-1 run on this host (rank 0 starts K - 1 workers), ranks
            K..N-1 join from other hosts (``nanovllm worker``); None: all N here.
        tp_rendezvous_timeout: seconds every rank may take to connect, above 0 and at most 86400 (None:
            :data:`RENDEZVOUS_TIMEOUT_S`, 300, set here when ``tensor_parallel_size`` > 1). Like the three
            above it places ranks, so ``tensor_parallel_size=1`` refuses a given value.
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    scheduling_policy: str = "priority"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    paged: bool = True
    attention_backend: str = "flash"
    seed: int | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    tp_master_addr: str | None = None
    tp_master_port: int | None = None
    tp_local_ranks: int | None = None
    tp_rendezvous_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in FLAG_FIELDS:  # first: the checks below read them by truthiness
            check_flag(name, getattr(self, name))

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 1 <= value <= COUNT_MAX):
                raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer up to {COUNT_MAX}")

        for name in ("block_size", "num_kv_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "num_speculative_tokens", "tensor_parallel_size"):
            positive(name)
        conflict = contiguous_conflict(self.paged, self.max_num_seqs, self.max_num_batched_tokens)
        if conflict:
            raise ValueError(conflict)
        if self.max_num_seqs is None:  # the default: told apart from a given 64, which paged=False refuses
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS if self.paged else 1
        # A byte count, not a count of things: its bound is 64 bits (a GPU's free memory is far above 2**31).
        memory = self.kv_cache_memory
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool)
                                   or not 1 <= memory <= BYTES_MAX):
            raise ValueError(f"kv_cache_memory={memory!r} is invalid: it must be a positive number of bytes up to "
                             f"{BYTES_MAX} (or None for a share of free memory)")
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise ValueError(f"model={self.model!r} is invalid: name a Hugging Face repo id, a folder or a .gguf "
                             "file, or leave it out (None) for the embedded default model")
        if self.block_size is not None and self.max_model_len is not None:
            check_block_size(self.block_size, self.max_model_len)
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} and kv_cache_memory={self.kv_cache_memory} both "
                             "size the KV pool and one would be ignored; give only one of them")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy={self.scheduling_policy!r} is unknown; use one of {', '.join(SCHEDULING_POLICIES)}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} is unknown; use one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.device is not None:
            check_device(self.device)
        if self.dtype is not None and (not isinstance(self.dtype, str) or self.dtype not in DTYPES):
            raise ValueError(f"dtype={self.dtype!r} is unknown; use float32, float16 or bfloat16")
        if self.max_model_len is not None:  # else checked by the engine once the model's context is known
            self.check_prefill_budget(self.max_model_len)

        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an integer in [{SEED_MIN}, {SEED_MAX}] "
                             "(64 bits) or None")
        self.quantization = tensor_parallel_quantization(normalize_quantization(self.quantization),
                                                         self.tensor_parallel_size)
        if explicit_quantized(self.quantization) and self.torch_device.type != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU (this engine's C kernels); "
                             f"use {setting('device', 'cpu')} or {setting('quantization', 'none')}")
        if explicit_quantized(self.quantization) and self.dtype is not None \
                and DTYPES[self.dtype] != torch.float32:
            raise ValueError(f"quantization={self.quantization!r} computes in float32; use dtype='float32' "
                             f"(--dtype float32) or {setting('quantization', 'none')}")
        self._check_speculative()
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if n is None:
            raise ValueError("tensor_parallel_size=None is invalid: it must be a positive integer (1: one process)")
        launch = {"tp_master_addr": self.tp_master_addr, "tp_master_port": self.tp_master_port,
                  "tp_local_ranks": self.tp_local_ranks, "tp_rendezvous_timeout": self.tp_rendezvous_timeout}
        if n == 1:
            given = [k for k, v in launch.items() if v is not None]
            if given:
                raise ValueError(f"{given[0]}={launch[given[0]]!r} places tensor-parallel ranks, but "
                                 f"tensor_parallel_size=1 runs one process; drop it or raise {setting('tensor_parallel_size')}")
            return
        self._check_tp_launch(n)
        if not self.paged:
            raise ValueError(f"tensor_parallel_size={n} needs the paged engine; drop paged=False "
                             f"(--no-paged-attention) or use {setting('tensor_parallel_size', 1)}")
        if self.speculative_model is not None:
            raise ValueError(f"speculative decoding does not run with tensor_parallel_size={n} yet; "
                             f"drop {setting('speculative_model')} or use {setting('tensor_parallel_size', 1)}")
        local = self.tp_local_ranks or n
        if self.torch_device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(f"tensor_parallel_size={n} with {local} rank(s) on this host on CUDA needs {local} GPUs, "
                             f"one per rank, but {torch.cuda.device_count()} are visible; lower {setting('tensor_parallel_size')} "
                             f"(or {setting('tp_local_ranks')}) or use {setting('device', 'cpu')}")

    def _check_tp_launch(self, n: int) -> None:
        """Where the ranks run: the listening address and port, the ranks on this host, the rendezvous timeout."""
        k, port, t = self.tp_local_ranks, self.tp_master_port, self.tp_rendezvous_timeout
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n):
            raise ValueError(f"tp_local_ranks={k!r} is invalid: it counts the ranks on rank 0's host, 1 (rank 0 alone) "
                             f"to tensor_parallel_size ({n})")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
            raise ValueError(f"tp_master_port={port!r} is invalid: a TCP port is 1 to 65535")
        if k is not None and k < n and port is None:
            raise ValueError(f"ranks {k} to {n - 1} join from other hosts (tp_local_ranks={k} of tensor_parallel_size="
                             f"{n}), which must be told where: give tp_master_port (--tp-master-port PORT)")
        if t is None:  # told apart from a given 300, which tensor_parallel_size=1 refuses
            t = self.tp_rendezvous_timeout = RENDEZVOUS_TIMEOUT_S
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400:
            raise ValueError(f"tp_rendezvous_timeout={t!r} is invalid: seconds, above 0 and at most 86400")
        if self.tp_master_addr is not None and (not isinstance(self.tp_master_addr, str)
                                                or not self.tp_master_addr.strip()):
            raise ValueError(f"tp_master_addr={self.tp_master_addr!r} is invalid: a host name or IP address of this host")

    def _check_speculative(self) -> None:
        spec = self.speculative_model
        if spec is None:
            if self.num_speculative_tokens is not None:
                raise ValueError("num_speculative_tokens is set but speculative_model is None; "
                                 "choose a proposer, e.g. speculative_model='ngram' (--speculative-model ngram)")
            return
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"speculative_model={spec!r} is invalid: use 'ngram', 'self:N', 'target' or a model path")
        if spec.startswith("self:"):
            layers = spec[len("self:"):]
            if not layers.isdigit() or int(layers) < 1:
                raise ValueError(f"speculative_model={spec!r} is invalid: 'self:N' needs a layer count N >= 1, "
                                 "e.g. 'self:8'")
        if not self.paged:
            raise ValueError("speculative decoding needs the paged engine; drop paged=False "
                             "(or --no-paged-attention)")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 5

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def unknown_options(cls, given: Any, takes: str = "LLM", extra: tuple[str, ...] = ()) -> str | None:
        """One line naming the names in ``given`` that are not settings (``EngineConfig`` fields or ``extra``,
        the caller's own keywords), with the nearest valid name and every valid one; None when all are known.

        vLLM's names with another spelling here are pointed to (``speculative_config``,
        ``gpu_memory_utilization``); otherwise the nearest name by spelling (``difflib``).
        """
        import difflib

        valid = sorted(cls.field_names() | set(extra))
        unknown = sorted(set(given) - set(valid))
        if not unknown:
            return None
        hints = []
        for name in unknown:
            near = VLLM_SPELLINGS.get(name) or " or ".join(difflib.get_close_matches(name, valid, n=2, cutoff=0.6))
            if near:
                hints.append(f"did you mean {near}?" if len(unknown) == 1 else f"{name}: did you mean {near}?")
        hint = f" ({'; '.join(hints)})" if hints else ""
        return (f"unknown {takes} option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hint}; {takes} takes "
                f"{', '.join(valid)} (help(EngineConfig) says what each does)")

    @property
    def torch_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return default_dtype(self.torch_device)

    def check_prefill_budget(self, max_model_len: int) -> None:
        """With chunked prefill off a prompt runs whole in one step, so the per-step budget must hold the
        longest prompt: vLLM refuses ``max_num_batched_tokens < max_model_len`` there when the engine is
        built. ``max_model_len``: the given one, or the model's context (``LLMEngine`` calls this then).

        Raises:
            SettingError: one line naming both settings and the three ways out.
        """
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and budget is not None and budget < max_model_len:
            raise SettingError(
                f"max_num_batched_tokens={budget} is below max_model_len ({max_model_len}) with "
                f"enable_chunked_prefill=False, so a prompt over {budget} tokens could never run (a whole prompt must "
                f"fit one step); raise max_num_batched_tokens to {max_model_len}, lower max_model_len, "
                "or drop enable_chunked_prefill=False")

    def token_budget(self, max_model_len: int) -> int:
        """The effective per-step token budget (``max_model_len`` in the contiguous baseline, whose one
        request runs its whole prompt in one step)."""
        if not self.paged:
            return max_model_len
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 512 if self.enable_chunked_prefill else max_model_len


# How long rank 0 waits for every tensor-parallel worker to connect, and a worker for rank 0 to listen, when
# tp_rendezvous_timeout is not given (torchrun's rendezvous waits 900 s; the ranks here are started by hand or
# by rank 0, so minutes suffice). engine/tp_launch.py uses it.
RENDEZVOUS_TIMEOUT_S = 300.0
DEFAULT_MAX_NUM_SEQS = 64  # max_num_seqs when not given (vLLM's default is 256 on a GPU)


# EngineConfig's yes/no settings: True or False only ('no', 'false' and 0.0 would otherwise act by truthiness).
FLAG_FIELDS = ("enable_prefix_caching", "enable_chunked_prefill", "paged")


def check_flag(name: str, value: Any) -> None:
    """Refuse a yes/no setting that is not a bool, in one line naming it.

    Python reads ``'no'``, ``'false'`` and ``'0'`` as true and ``0.0`` as false, so a string from a
    config file or an environment variable would silently turn the feature on (trial 20c).

    Raises:
        ValueError: ``value`` is not ``True`` or ``False`` (``enable_prefix_caching='no' is invalid: ...``).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name}={shown(value, as_json=False)} is invalid: it must be True or False")


DEVICE_NAME = re.compile(r"(cpu|cuda)(:[0-9]+)?", re.ASCII)


def check_device(device: Any) -> None:
    """Accept ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (N a GPU this process sees), or a ``torch.device`` of them.

    Raises:
        ValueError: any other name (torch's own error lists a score of device types this engine does
            not run on), or a CUDA device this machine does not have, in one line naming the field.
    """
    if isinstance(device, torch.device):
        name = str(device)
    elif isinstance(device, str):
        name = device
    else:
        raise ValueError(f"device={device!r} is invalid: use 'cpu', 'cuda' or 'cuda:N' (a string)")
    if not DEVICE_NAME.fullmatch(name):
        raise ValueError(f"device={device!r} is unknown; use cpu, cuda or cuda:N (N: a GPU's index)")
    if not name.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but no CUDA GPU is available; use device='cpu' (--device cpu)")
    index, count = torch.device(name).index, torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"device={name!r} was asked for but this machine has {count} CUDA GPU(s) "
                         f"(cuda:0 to cuda:{count - 1}); use one of them or device='cuda'")


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype used when none was asked for: float32 on the CPU (the reference mode); on CUDA
    bfloat16 at compute capability 8.0 (Ampere) or newer, float16 before.

    Older GPUs have no bfloat16 arithmetic: ``torch.cuda.is_bf16_supported()`` still says
    yes there (emulated, and slow), and it asks about the current device, not ``device``.
    """
    if device.type != "cuda":
        return torch.float32
    major, _minor = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: free GPU memory on CUDA, ``MemAvailable`` on Linux, else a guess of 4 GiB.

    On CUDA the caching allocator's unused blocks are released first: memory freed while
    loading (PyTorch keeps it cached) would otherwise count as used and shrink the KV pool.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def default_kv_cache_memory(device: torch.device) -> int:
    """The default KV pool budget in bytes: half of free GPU memory, or an eighth of free RAM capped at 2 GiB on CPU.

    The CPU cap keeps start-up quick (the pool is zero-filled) while holding tens of
    thousands of tokens for a small model (SmolLM2-135M in float32: 45 KiB per token).
    """
    free = available_memory_bytes(device)
    if device.type == "cuda":
        return free // 2
    return min(free // 8, 2 << 30)


def check_block_size(block_size: int, max_model_len: int) -> None:
    """Refuse a KV block longer than the longest sequence: a block holds tokens of one sequence, so the
    tokens past ``max_model_len`` could never be filled (a block of a million tokens asked for tens of GiB).

    Raises:
        ValueError: ``block_size > max_model_len``, in one line saying what to use.
    """
    if block_size > max_model_len:
        raise SettingError(f"block_size={block_size} is longer than max_model_len ({max_model_len} tokens), and a block "
                         f"holds tokens of one sequence; use block_size {max_model_len} or less (--block-size)")


def check_kv_budget(kv_cache_memory: int, block_size: int, bytes_per_block: int) -> None:
    """Refuse a ``kv_cache_memory`` budget smaller than one KV block (``bytes_per_block``, a draft model's
    share included), which would otherwise become a one-block pool the user did not ask for.

    Raises:
        ValueError: ``kv_cache_memory < bytes_per_block``, in one line naming the block's bytes.
    """
    if kv_cache_memory < bytes_per_block:
        raise SettingError(f"kv_cache_memory={kv_cache_memory} bytes is smaller than one KV block of {block_size} "
                         f"tokens ({bytes_per_block} bytes, {format_bytes(bytes_per_block)}); give at least "
                         f"{bytes_per_block}, or size the pool in blocks with num_kv_blocks (--num-kv-blocks)")


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest unit of KiB, MiB, GiB that keeps the number at 1 or more (``"720.0 KiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_kv_pool_fits(num_blocks: int, bytes_per_block: int, device: torch.device) -> None:
    """Refuse a KV pool larger than 90% of the memory free now, before allocating any of it.

    Without this check an oversized ``num_kv_blocks`` or ``kv_cache_memory`` gets the process
    killed by the operating system with no message while the pool is zero-filled.

    Raises:
        ValueError: ``num_blocks * bytes_per_block`` (bytes) exceeds 90% of the free memory of ``device``.
    """
    need, free = num_blocks * bytes_per_block, available_memory_bytes(device)
    if need <= 0.9 * free:
        return
    pool = f"a KV pool of {num_blocks} block{'s' if num_blocks != 1 else ''} needs {need / 2**30:.1f} GiB " \
           f"({bytes_per_block / 2**20:.2f} MiB a block) but only {free / 2**30:.1f} GiB of {device.type} memory is free"
    if bytes_per_block > 0.9 * free:  # one block alone does not fit: fewer blocks cannot help
        raise SettingError(f"{pool}; one block alone does not fit, so lower block_size (--block-size)")
    raise SettingError(f"{pool}; lower num_kv_blocks (--num-kv-blocks) or kv_cache_memory")


SUPPORTED_MODEL_TYPES = ("llama",)

# What to do about a model file whose numbers cannot be right: the fault is in the file, not a cache.
FILE_FAULT = "the file is corrupt or not a LLaMA-family model; get a fresh copy"
# The size fields of a Hugging Face LLaMA config (head_dim may be absent: hidden_size / heads).
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings")
# Past these no LLaMA-family model goes (Llama 3.1 405B: 126 layers, 16,384 wide, 128K context):
# a bigger number is overwritten bytes, and building a model that size would hang or exhaust memory.
MAX_LAYERS = 4096
MAX_SIZE = 2**31 - 1


def config_fault(where: str, key: str, value: Any, why: str) -> str:
    """The one-line refusal of a model configuration's field: ``<where>: <key> is <value>, <why>; <what to do>``."""
    return f"{where}: {key} is {value!r}, {why}; {FILE_FAULT}"


def architecture_problem(raw: dict[str, Any], names: dict[str, str] | None = None) -> tuple[str, Any, str] | None:
    """The first number of a LLaMA configuration that cannot be right, as ``(field, value, why)``; None when all can.

    ``raw`` maps Hugging Face field names (:data:`_SIZE_FIELDS`, ``rms_norm_eps``, ``rope_theta``,
    ``rope_scaling``) to the values read from the file; ``head_dim`` None means hidden_size / heads.
    Checked: every size a whole number from 1 up (layers at most :data:`MAX_LAYERS`, others
    :data:`MAX_SIZE`); the KV heads dividing the query heads; the head size even (rotary pairs)
    and, when not given, hidden_size a multiple of the heads; rms_norm_eps finite in (0, 1);
    rope_theta finite and above 0; a rope scaling's factors finite and above 0 (llama3's
    high_freq_factor above its low_freq_factor, its original context a whole number from 1).
    ``names`` spells a field as the file does; a fault between two fields (the KV heads not dividing
    the query heads) names the other one in ``why`` too, since either may be the one that is wrong.
    """
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    for key in _SIZE_FIELDS:
        value = raw.get(key)
        if key == "head_dim" and value is None:
            continue
        most = MAX_LAYERS if key == "num_hidden_layers" else MAX_SIZE
        if isinstance(value, bool) or not isinstance(value, int):
            return key, value, "not a whole number"
        if not 1 <= value <= most:
            return key, value, f"outside 1 to {most:,}"
    heads, kv = raw["num_attention_heads"], raw["num_key_value_heads"]
    if heads % kv:
        return ("num_key_value_heads", kv,
                f"which does not divide {name('num_attention_heads')} {heads} (one of the two is wrong)")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if raw["hidden_size"] % heads:
            return ("hidden_size", raw["hidden_size"],
                    f"not a multiple of {name('num_attention_heads')} {heads} (one of the two is wrong)")
        head_dim = raw["hidden_size"] // heads
    if head_dim % 2:
        return "head_dim", head_dim, "odd, where rotary embedding turns pairs of numbers"
    eps = raw.get("rms_norm_eps")
    if not _real(eps) or not 0 < eps < 1:
        return "rms_norm_eps", eps, "not a number in (0, 1)"
    theta = raw.get("rope_theta")
    if not _real(theta) or not theta > 0:
        return "rope_theta", theta, "not a finite number above 0"
    scaling = raw.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        needed = ("factor", "low_freq_factor", "high_freq_factor") if kind == "llama3" else ("factor",)
        for key in needed:
            if not _real(scaling.get(key)) or not scaling[key] > 0:
                return f"rope_scaling.{key}", scaling.get(key), "not a finite number above 0"
        if kind == "llama3":
            if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                return ("rope_scaling.high_freq_factor", scaling["high_freq_factor"],
                        f"not above low_freq_factor {scaling['low_freq_factor']!r}")
            old = scaling.get("original_max_position_embeddings")
            if isinstance(old, bool) or not isinstance(old, int) or not 1 <= old <= MAX_SIZE:
                return ("rope_scaling.original_max_position_embeddings", old,
                        f"not a whole number from 1 to {MAX_SIZE:,}")
    return None


def _real(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers of a LLaMA-family checkpoint.

    Built from a Hugging Face ``LlamaConfig`` with :meth:`from_hf`. Sizes are counts
    (heads, layers, tokens); ``head_dim`` is in elements.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_type: str = "llama"

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (1 = multi-head, >1 = GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @staticmethod
    def from_hf(hf_config: Any, where: str = "config.json", names: dict[str, str] | None = None) -> "ModelConfig":
        """Read a transformers config (v4 or v5 field layout), checking every number first.

        ``where`` names the file in the refusal (a config.json path, or the GGUF file it came from);
        ``names`` spells a field as that file does (``{"num_hidden_layers": "llama.block_count"}``).

        Raises:
            ValueError: the model type is not LLaMA-family, a needed field is missing, or a number
                cannot be right (:func:`architecture_problem`), in one line naming ``where``, the field
                and its value, and what to do.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; this engine runs LLaMA-family "
                f"models (model_type in {list(SUPPORTED_MODEL_TYPES)}, e.g. SmolLM2, TinyLlama, Llama 2/3)"
            )
        # transformers v5 keeps rope settings in `rope_parameters`; v4 in rope_theta/rope_scaling.
        rope_params = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_theta = rope_params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_scaling = getattr(hf_config, "rope_scaling", None)
        if not rope_scaling and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling:
            if not isinstance(rope_scaling, dict):
                raise ValueError(config_fault(where, (names or {}).get("rope_scaling", "rope_scaling"), rope_scaling,
                                              "is not an object of rope settings"))
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind == "default":
                rope_scaling = None
            elif kind not in ("llama3", "linear"):
                raise ValueError(
                    f"rope_scaling of type {kind!r} is not supported (supported: 'llama3', 'linear')"
                )
        raw = {key: getattr(hf_config, key, None) for key in _SIZE_FIELDS}
        if raw["num_key_value_heads"] is None:  # absent: multi-head attention (0 is a value, and refused)
            raw["num_key_value_heads"] = raw["num_attention_heads"]
        if raw["max_position_embeddings"] is None:
            raw["max_position_embeddings"] = 2048
        raw["rms_norm_eps"] = getattr(hf_config, "rms_norm_eps", None)
        raw["rope_theta"] = rope_theta
        raw["rope_scaling"] = rope_scaling
        problem = architecture_problem(raw, names)
        if problem is not None:
            key, value, why = problem
            raise ValueError(config_fault(where, (names or {}).get(key, key), value, why))
        # vLLM's LlamaMLP refuses any other activation; running SiLU in its place gave plausible garbage.
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(config_fault(where, (names or {}).get("hidden_act", "hidden_act"), act,
                                          "not an activation this engine runs (LLaMA-family models use silu, the "
                                          "only one supported)"))
        num_heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
        head_dim = raw["head_dim"] or hidden // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        bos = getattr(hf_config, "bos_token_id", None)
        vocab = raw["vocab_size"]
        for key, ids in (("bos_token_id", () if bos is None else (bos,)), ("eos_token_id", eos_ids)):
            for token in ids:  # an id past the vocabulary would index past the embedding, or never stop a request
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                    raise ValueError(config_fault(where, (names or {}).get(key, key), token,
                                                  f"not a token id of the {vocab:,}-token vocabulary "
                                                  f"({(names or {}).get('vocab_size', 'vocab_size')})"))
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=head_dim,
            rms_norm_eps=float(raw["rms_norm_eps"]),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            model_type=model_type,
        )

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name a model of this configuration needs, with its whole shape
        (elements; ``[out, in]`` for a linear layer's weight)."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h),
                                             "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            names["lm_head.weight"] = (self.vocab_size, h)
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            names.update({
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
            if self.attention_bias:
                names.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                              p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)})
            if self.mlp_bias:
                names.update({p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,),
                              p + "mlp.down_proj.bias": (h,)})
        return names

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV cache one token occupies: 2 (K and V) x layers x kv_heads x head_dim x dtype size."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + lm_head

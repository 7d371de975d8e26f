"""The engine loop: schedule -> run -> sample -> update -> emit events.

``LLMEngine`` is the lower-level API (vLLM's ``LLMEngine``): ``add_request``, ``step``,
``abort_request``, ``has_unfinished_requests``. ``LLM.generate`` and the
``EngineController`` thread drive it. One call of :meth:`LLMEngine.step` is one scheduler
step: one forward pass over a mixed batch of prefill chunks and decodes (and, with
speculative decoding, the drafted tokens). Sampling is one path for plain and verification
rows (``sampling/sampler.py``); what happens to each kept token is the output processor's
job (``output_processor.py``); what the engine tells its listeners (subscriptions, the
events of a step, the X-Ray observer) is ``event_source.py``'s, the base class.

Why this file runs past ~400 lines: ``LLMEngine`` is one object whose parts share one
state (the requests, scheduler, runner, sampler and speculator of a step), and construction,
requests, the step and its statistics read best in the order the step uses them.
"""

from __future__ import annotations

import itertools
import time
import traceback
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch

from nanovllm_core import events as ev
from nanovllm_core import yield_gate
from nanovllm_core.attention import cpu_paged
from nanovllm_core.attention.selector import DEFAULT_BLOCK_SIZE, default_block_size
from nanovllm_core.config import EngineConfig, check_block_size, check_kv_budget, check_kv_pool_fits, default_kv_cache_memory
from nanovllm_core.engine import observer
from nanovllm_core.engine.block_manager import BlockManager
from nanovllm_core.engine.clock import EngineClock
from nanovllm_core.engine.device_errors import is_fatal_device_error
from nanovllm_core.engine.detokenizer import start_detokenizer
from nanovllm_core.engine.event_source import EventSource, Subscription  # noqa: F401  (Subscription re-exported)
from nanovllm_core.engine.model_runner import ForwardResult, ModelRunner
from nanovllm_core.engine.output_processor import OutputProcessor, RequestState, StepStamp
from nanovllm_core.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from nanovllm_core.engine.sequence import Sequence, SequenceStatus
from nanovllm_core.model import block_quant, native_ops
from nanovllm_core.model.llama import LlamaForCausalLM, ModelConfig
from nanovllm_core.engine.tensor_parallel import TensorParallelError, WorkerGroup, refuse_in_spawned_import
from nanovllm_core.model import parallel
from nanovllm_core.model.loader import ProgressFn, ResolvedModel
from nanovllm_core.model.quantization import (
    AUTO,
    BLOCK_MODES,
    built_quantization,
    describe_weights,
    weight_formats,
    linear_weight_bytes,
    linear_weight_count,
)
from nanovllm_core.outputs import RequestOutput
from nanovllm_core.prompts import (Prompt, content_text, conversation_problem, describe, is_conversation,
                                   template_message, chat_template_problem)
from nanovllm_core.sampling.sampler import RowGroup, Sampler, SamplerOutput, SamplingRow
from nanovllm_core.prompts import unicode_problem
from nanovllm_core.sampling_params import FCFS_FIX, SamplingParams, check_priority, max_tokens_overflow
from nanovllm_core.speculative.metrics import SpecDecodeStats
from nanovllm_core.speculative.proposer import build_proposer, load_draft_model, needs_draft_model, parse_self_layers
from nanovllm_core.speculative.speculator import Speculator
from nanovllm_core import untrusted
from nanovllm_core.untrusted import shown

FINISHED_IDS_KEPT = 1024  # ended request ids remembered (select_xray accepts them; the app lists at most 200)


class EngineDeadError(RuntimeError):
    """The engine has stopped for good (a tensor-parallel worker died, hung or failed; the device failed)
    and takes no new work: ``LLM.generate`` and ``LLM.chat`` raise it, as vLLM's ``EngineDeadError``.
    The message is ``LLMEngine.fatal_error``: one line naming the cause and saying to restart."""



def planned_block_size(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                       dtype: torch.dtype) -> int:
    """Tokens per KV block the engine will use: ``config.block_size``, else the attention backend's
    default for ``device``, ``dtype`` and the model's head size (16 on a CPU; 256 where flash-attn
    runs), 16 for the contiguous baseline. Known before any weight loads (``nanovllm serve`` checks
    its pool against ``max_model_len`` with it)."""
    return config.block_size or (
        default_block_size(device, dtype, model_config.head_dim, config.attention_backend)
        if config.paged else DEFAULT_BLOCK_SIZE)

class LLMEngine(EventSource):
    """A paged-attention inference engine over one model.

    Build it with :meth:`from_config` (loads the model) or directly from a loaded model.
    Not thread-safe: one thread drives it (``EngineController`` does so for the app).
    """

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Any,
                 resolved: ResolvedModel | None = None, workers: WorkerGroup | None = None) -> None:
        if config.tensor_parallel_size > 1 and workers is None:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs worker processes; build the "
                             "engine with LLMEngine.from_config (or LLM(...)), which starts them")
        self.config = config
        self.model = model
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.resolved = resolved
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Auto (config.quantization None) takes the mode a given model was built with (the loader
        # decided it, model.quantization.resolve_quantization); a named mode must match it.
        built = getattr(model, "quantization", None)
        if config.quantization is not None and built_quantization(config.quantization) != built:
            raise ValueError(f"the model's linear layers were built with quantization={built!r} but the engine was "
                             f"asked for {config.quantization!r}; load the model with that quantization")
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        config.check_prefill_budget(self.max_model_len)  # before anything is allocated (vLLM refuses it at start-up too)
        spec = config.speculative_model
        if spec is not None and spec.startswith("self:"):
            parse_self_layers(spec, self.model_config.num_hidden_layers)  # fail before allocating anything
        draft = load_draft_model(spec, model, self.device, self.dtype, self.max_model_len) if needs_draft_model(spec) else None
        block_size = planned_block_size(config, self.model_config, self.device, self.dtype)
        if config.block_size is not None:  # asked for: no longer than a sequence can be (the default is chosen to fit)
            check_block_size(config.block_size, self.max_model_len)
        self.kv_dtype = self.dtype  # K/V in the model's dtype; the runner makes the same choice
        bytes_per_block = self.model_config.kv_bytes_per_token(self.kv_dtype) * block_size
        # A draft model's pool has one block per target block: the memory budget pays for both.
        draft_bytes_per_block = draft.config.kv_bytes_per_token(self.dtype) * block_size if draft else 0
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory is not None:  # the budget asked for: never silently rounded up to a block
            check_kv_budget(config.kv_cache_memory, block_size, bytes_per_block + draft_bytes_per_block)
            num_blocks = config.kv_cache_memory // (bytes_per_block + draft_bytes_per_block)
        else:
            num_blocks = max(1, default_kv_cache_memory(self.device) // (bytes_per_block + draft_bytes_per_block))
        self.bytes_per_block = bytes_per_block
        paged = config.paged
        if paged:
            check_kv_pool_fits(num_blocks, bytes_per_block + draft_bytes_per_block, self.device)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching and paged)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs if paged else 1,
            token_budget=config.token_budget(self.max_model_len) if paged else self.max_model_len,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill and paged,
            num_speculative_tokens=config.num_speculative_tokens if spec else 0,
            max_model_len=self.max_model_len,
            reserve_up_front=not paged,
        )
        self.runner = ModelRunner(model, block_size, num_blocks, paged, config.attention_backend, self.max_model_len,
                                  workers=workers)
        if workers is not None:  # each worker's slice of the pool: the same block ids, its own KV heads
            workers.build_runners(block_size, num_blocks, config.attention_backend, self.max_model_len)
        self.speculator: Speculator | None = (
            Speculator(build_proposer(spec, self.runner, draft), config.num_speculative_tokens) if spec else None
        )
        self.sampler = Sampler()
        self.eos_token_ids = self._eos_ids()
        self.requests: dict[str, RequestState] = {}
        # Ids of the newest FINISHED_IDS_KEPT requests that ended (finished, aborted, rejected), oldest first:
        # what "known" means for select_xray beside the live ``requests``.
        self.finished_ids: OrderedDict[str, None] = OrderedDict()
        self._subscribers: list[Subscription] = []
        self._seq_counter = itertools.count()
        self._request_counter = itertools.count()
        self.step_index = 0
        self._waste_peak: tuple[int, int | None] = (0, None)  # (slots, step): see _note_waste
        self.clock = EngineClock()  # request times; a controller stops it while it holds the engine paused
        self.output = OutputProcessor(tokenizer, self.max_model_len, self.clock)
        self.fault_injector: Callable[[SchedulerOutput], None] | None = None  # tests: raise inside a step
        self.fatal_error: str | None = None  # set when the device failed for good; new requests are rejected
        self._step_traced = False  # the step being run is X-Ray captured (StepTimed.traced)
        self.xray = None  # the layer observer (X-Ray capture), made when a subscriber first asks for LayerTrace events
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.runner.warm_up()  # the first forward pass's one-time costs (every rank's), paid here, not by the first step

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, config: EngineConfig, progress: ProgressFn | None = None) -> "LLMEngine":
        """Resolve and load the model named in ``config``, then build the engine.

        Raises:
            ModelLoadError: the model cannot be found or loaded (one-line message).
            ValueError: ``progress`` cannot be called as ``progress(stage, done, total)``.
        """
        from nanovllm_core.model.loader import check_progress, load_model

        check_progress(progress)
        if config.tensor_parallel_size > 1:
            return cls._from_config_parallel(config, progress)
        model, tokenizer, resolved = load_model(config.model, config.torch_device, config.torch_dtype,
                                                max_model_len=config.max_model_len, progress=progress,
                                                quantization=config.quantization)
        return cls(config, model, tokenizer, resolved)

    @classmethod
    def _from_config_parallel(cls, config: EngineConfig, progress: ProgressFn | None) -> "LLMEngine":
        """Tensor parallelism: check the size against the model's config, start the workers, load shard 0 here.

        Raises:
            ModelLoadError: the model cannot be found or loaded.
            ValueError: the size does not split the model (before any process starts).
            TensorParallelError: a worker failed to start, join or load.
        """
        from nanovllm_core.model.loader import load_model, read_model_config, resolve_model

        refuse_in_spawned_import()  # a worker re-importing a script without the __main__ guard: one line, no load
        n = config.tensor_parallel_size
        resolved = resolve_model(config.model, progress)  # converts a GGUF file once, before any worker reads it
        model_config = read_model_config(resolved)
        parallel.check_size(model_config, n, resolved.name)
        local = config.tp_local_ranks or n
        if progress and local > 1:
            progress(f"starting {local - 1} tensor-parallel worker(s)", 0, 1)
        workers = WorkerGroup(n, config.torch_device, str(resolved.path), model_config,
                              str(config.torch_dtype).replace("torch.", ""), config.max_model_len,
                              master_addr=config.tp_master_addr, master_port=config.tp_master_port, local_ranks=local,
                              rendezvous_timeout_s=config.tp_rendezvous_timeout)
        try:
            model, tokenizer, resolved = load_model(config.model, config.torch_device, config.torch_dtype,
                                                    max_model_len=config.max_model_len, progress=progress,
                                                    quantization=config.quantization, tensor_parallel=workers.tp)
            workers.wait_loaded(progress)
            return cls(config, model, tokenizer, resolved, workers=workers)
        except BaseException:
            workers.shutdown()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers and destroy the process group (idempotent; nothing to do with one process).

        Live requests are finished with an error first, so no KV block stays allocated.
        """
        workers = self.runner.workers
        if workers is None or workers.closed:
            return
        if self.requests:
            self.fail_running("the engine was closed")
        self.runner.close()
        if self.fatal_error is None:
            self.fatal_error = "the engine was closed; build a new one"

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return tuple(sorted(ids))

    @property
    def model_name(self) -> str:
        return self.resolved.name if self.resolved else "model"

    def model_info(self) -> dict[str, Any]:
        """Facts about the model and the KV pool, for headers and explanations (sizes in elements, tokens, bytes);
        plus what the installed observer adds (the X-Ray: the machine's roofline when it was measured
        before; see ``engine/observer.py``)."""
        plug = observer.installed()
        c = self.model_config
        return {
            **(plug.facts(self) if plug is not None else {}),
            "model_name": self.model_name, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
            "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "vocab_size": c.vocab_size, "num_parameters": c.num_parameters(),
            "kv_bytes_per_token": c.kv_bytes_per_token(self.kv_dtype), "kv_dtype": str(self.kv_dtype).replace("torch.", ""),
            "block_size": self.block_manager.block_size,
            "num_kv_blocks": self.block_manager.num_blocks, "max_model_len": self.max_model_len,
            "max_position_embeddings": c.max_position_embeddings,  # the most max_model_len may be
            "max_num_seqs": self.scheduler.max_num_seqs, "token_budget": self.scheduler.token_budget,
            "scheduling_policy": self.scheduler.policy, "prefix_caching": self.block_manager.enable_prefix_caching,
            "chunked_prefill": self.scheduler.enable_chunked_prefill, "chat_template": self.has_chat_template,
            # Speculative decoding: the proposer's name (None: off) and k, the most drafts a step verifies.
            "speculative_model": self.speculator.name if self.speculator else None,
            "num_speculative_tokens": self.speculator.k if self.speculator else 0,
            "paged": self.config.paged, "attention_backend": self.runner.attention_kernel,
            # Why the CPU paged kernel is not the one running (no compiler, a failed build, ...), or None.
            "cpu_paged_unavailable": (None if self.runner.use_cpu_paged else
                                      cpu_paged.unsupported_reason(self.device, self.dtype, self.config.attention_backend)),
            # Why RMSNorm and RoPE run as PyTorch ops instead of in C (model/native_ops.py) on the CPU, or None.
            "native_ops_unavailable": native_ops.unavailable_reason() if self.device.type == "cpu" else None,
            # Weights of every linear layer and the LM head, as the loader built them: the bytes
            # one decode step streams from memory (what batching shares among the batch).
            "quantization": self.model.quantization, "linear_weight_bytes": linear_weight_bytes(self.model),
            # What was asked: "auto" (the default, decided at load), "none" or a mode's name.
            "quantization_requested": self._quantization_requested(),
            # What the weights run as, by format and bytes ("q4_1 66 MB + q8_0 30 MB (96 MB of weights)"),
            # and a note when some of a GGUF file's tensors are in formats that run dequantized.
            "weight_format": describe_weights(self.model),
            "weight_kinds": "+".join(weight_formats(self.model)),
            "quantization_note": getattr(self.model, "quantization_note", None),
            # Why block-quantized layers run PyTorch's fallback instead of block_quant_cpu.c, or None.
            "block_native_unavailable": (block_quant.unavailable_reason()
                                         if self.model.quantization in BLOCK_MODES else None),
            "linear_weights": linear_weight_count(self.model),
            **self._tensor_parallel_info(),
        }

    def _tensor_parallel_info(self) -> dict[str, Any]:
        """model_info's tensor-parallel facts: the size, the backend, and what each rank holds of one layer
        (``model.parallel.shard_spans``: head, intermediate and vocabulary spans, weight and KV-pool shapes).

        With tensor parallelism, ``linear_weight_bytes`` above is rank 0's shard; ``kv_bytes_per_token``
        and ``num_kv_blocks`` are the whole pool's (every rank holds each block's slice of its KV heads).
        """
        n = self.config.tensor_parallel_size
        workers = self.runner.workers
        c, bm = self.model_config, self.block_manager
        return {
            "tensor_parallel_size": n,
            "tensor_parallel_backend": workers.backend if workers is not None else None,
            "tensor_parallel_pids": tuple(workers.pids) if workers is not None else (),
            # Per forward pass: an all-reduce after every o_proj and down_proj, one for the embedding; a gather of logits.
            "tensor_parallel_all_reduces_per_forward": 2 * c.num_hidden_layers + 1 if n > 1 else 0,
            "tensor_parallel_all_reduce_bytes_per_token": c.hidden_size * self.dtype.itemsize if n > 1 else 0,
            "tensor_parallel_shards": tuple(parallel.shard_spans(c, r, n, bm.num_blocks, bm.block_size)
                                            for r in range(n)) if n > 1 else (),
        }

    def _quantization_requested(self) -> str:
        """``"auto"``, ``"none"`` or a mode: the engine's setting, or for auto what the loader was asked."""
        if self.config.quantization is not None:
            return self.config.quantization
        return getattr(self.model, "quantization_requested", None) or AUTO

    # ------------------------------------------------------------------ requests

    def _ended(self, request_id: str) -> None:
        """Keep ``request_id`` among the newest ended ids (``finished_ids``), the oldest dropped past ``FINISHED_IDS_KEPT``."""
        self.finished_ids.pop(request_id, None)
        self.finished_ids[request_id] = None
        while len(self.finished_ids) > FINISHED_IDS_KEPT:
            self.finished_ids.popitem(last=False)

    def _reject(self, request_id: str, prompt: Any, token_ids: list[int], reason: str,
                params: SamplingParams | None = None, priority: int | None = None) -> str:
        self._ended(request_id)
        self.output.reject(request_id, prompt, token_ids, reason)
        if self._subscribers:
            self._emit(ev.RequestRejected(request_id=request_id, reason=reason, priority=priority,
                                          max_tokens=params.max_tokens if params is not None else None))
        return request_id

    def new_request_id(self) -> str:
        return str(next(self._request_counter))

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt given as text, as token ids, or as a
        conversation (chat messages, rendered with the model's chat template).

        Raises:
            ValueError: none of those, text that is not valid Unicode (a lone surrogate such as
                ``"\\ud800"``, which has no UTF-8 form), a chat message with a role outside
                ``prompts.CHAT_ROLES`` (what the server refuses), or a conversation the model has no
                template for or the template refuses.
        """
        if isinstance(prompt, str):
            problem = unicode_problem(prompt)
            if problem is not None:
                raise ValueError(f"the prompt is not valid Unicode: {problem}")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        if is_conversation(prompt):
            problem = conversation_problem(prompt)  # a role the server refuses too (CHAT_ROLES)
            if problem is not None:
                raise ValueError(problem)
            for message in prompt:
                problem = unicode_problem(content_text(message["content"]))
                if problem is not None:
                    raise ValueError(f"a chat message is not valid Unicode: {problem}")
            return None, self.chat_token_ids(list(prompt))
        raise ValueError("prompt must be a string, a list of token ids, or a list of chat messages "
                         f"({{'role': ..., 'content': text}}), got {describe(prompt)}")

    def request_problem(self, token_ids: list[int], params: SamplingParams,
                        fit_context: bool = False) -> tuple[str, str] | None:
        """Why this engine could never serve ``token_ids`` with ``params``: ``(field, one-line reason)``
        where field is ``"prompt"``, ``"stop_token_ids"``, ``"logit_bias"``, ``"n"`` or ``"max_tokens"``; None when it can.

        ``fit_context``: also refuse a ``max_tokens`` that does not fit after the prompt in
        ``max_model_len`` (vLLM's server rule, :func:`~nanovllm_core.sampling_params.max_tokens_overflow`);
        without it such a request runs and stops at ``max_model_len`` with ``finish_reason="length"``
        (vLLM's ``LLM``).

        The checks :meth:`add_request` rejects by, offered so a server can refuse before it
        answers (an HTTP 400 rather than an error inside a stream that has begun). They read
        only settings fixed at construction, so any thread may call this.
        """
        vocab = self.model_config.vocab_size
        n_prompt = len(token_ids)
        if n_prompt == 0:
            return "prompt", "the prompt is empty; give at least one token of text"
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            return "prompt", f"token id {shown(bad[0])} is outside the vocabulary (0..{vocab - 1})"
        context = self.model_config.max_position_embeddings  # max_model_len cannot be raised past it
        if n_prompt >= self.max_model_len:
            return "prompt", (f"the prompt has {n_prompt} token{'s' if n_prompt != 1 else ''} but max_model_len is {self.max_model_len}, "
                    "which must also leave room for at least one output token; " +
                    ("shorten the prompt or raise max_model_len (--max-model-len)" if self.max_model_len < context
                     else "shorten the prompt (max_model_len is already the model's whole context)"))
        overflow = (max_tokens_overflow(n_prompt, params.max_tokens, self.max_model_len, model_context=context)
                    if fit_context else None)
        if overflow is not None:
            return "max_tokens", overflow
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            return "stop_token_ids", f"stop_token_ids contains {shown(bad[0])}, outside the vocabulary (0..{vocab - 1})"
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            return "logit_bias", f"logit_bias has the token id {shown(bad[0])}, outside the vocabulary (0..{vocab - 1})"
        if params.n > 1 and not self.config.paged:  # the mode's own rule, not a setting that could be raised
            return "n", (f"n={params.n}: this engine runs one sequence at a time (the contiguous baseline): use n=1 "
                         "or run without --no-paged-attention (paged=False)")
        if params.n > self.scheduler.max_num_seqs:  # n sequences run side by side: more could never all be admitted
            return "n", (f"n={params.n} asks for more sequences than this engine runs at once "
                         f"(max_num_seqs={self.scheduler.max_num_seqs}); lower n or raise max_num_seqs (--max-num-seqs)")
        pool = self.block_manager.num_blocks
        # Paged: a sampled token's K/V is written only by the step that feeds it back in, so a request that
        # ends at its max_tokens-th token never stores that one: at most the prompt and max_tokens - 1
        # outputs (trial 29d: 5 + 12 tokens, 16 stored, was refused a 16-token pool). The contiguous
        # baseline reserves its whole prompt + max_tokens up front (Scheduler.reservation).
        unstored = 1 if self.config.paged else 0
        least = self.block_manager.blocks_needed(n_prompt + 1 - unstored)  # max_tokens=1
        if least > pool:  # no max_tokens would fit: the prompt is at fault
            kept = "whose K/V" if unstored else "which with one output token"
            return "prompt", (f"the prompt has {n_prompt} token{'s' if n_prompt != 1 else ''}, {kept} "
                    f"needs {least} KV blocks but the pool has only {pool}; shorten the prompt or raise num_kv_blocks (--num-kv-blocks)")
        limit = min(self.max_model_len, n_prompt + (params.max_tokens or self.max_model_len)) - unstored
        need = self.block_manager.blocks_needed(limit)
        if need > pool:  # the prompt fits: it is max_tokens (or, absent, max_model_len) that pushes it over
            if unstored:
                wants = f"may need {need} KV blocks (K/V of {limit} token{'s' if limit != 1 else ''})"
            else:  # it reserves, not may need: one of those slots (the last token's) is never written (trial 35e)
                wants = (f"reserves {need} KV blocks up front ({limit} token slots: its prompt + max_tokens, the whole "
                         "sequence the contiguous baseline sets aside, the last token's slot included though its K/V "
                         "is never written)")
            return "max_tokens", (f"the request {wants} but the pool has only "
                    f"{self.block_manager.num_blocks}; raise num_kv_blocks (--num-kv-blocks) or lower max_tokens")
        # Unreachable through EngineConfig (check_prefill_budget: budget >= max_model_len > n_prompt when chunked
        # prefill is off); kept for a scheduler given a smaller budget, where such a prompt would wait forever.
        if not self.scheduler.enable_chunked_prefill and n_prompt > self.scheduler.token_budget:
            return "prompt", (f"the prompt has {n_prompt} token{'s' if n_prompt != 1 else ''}, more than the per-step budget "
                    f"({self.scheduler.token_budget}) with chunked prefill off; enable chunked prefill")
        return None

    def check_priority(self, priority: object, name: str = "priority", fix: str = FCFS_FIX) -> int:
        """``priority`` if this engine takes it: -1000 to 1000, and 0 only under ``scheduling_policy="fcfs"``
        (as vLLM: "Priority scheduling is not enabled"). The rule of every entry point that has an engine
        (``LLM.generate``, ``add_request``, the controller, the server); ``fix``: what to do, in the
        caller's option names. Raises: ValueError, one line (``sampling_params.check_priority``)."""
        return check_priority(priority, name, policy=self.scheduler.policy, fix=fix)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0,
                    request_id: str | None = None, fit_context: bool = False,
                    chat: list[dict[str, Any]] | None = None,
                    arrival: tuple[float, float] | None = None) -> str:
        """Queue a request; return its id.

        ``chat``: the conversation a caller rendered into ``prompt``'s token ids with the chat template
        itself (``LLM.chat``, ``nanovllm --chat``, the server's chat completions), so the views tell the
        prompt as that conversation put through the template, not as ids typed in (trial 24d #2); a
        conversation given as ``prompt`` is told so without it. It changes nothing the engine computes.

        ``fit_context``: also reject a ``max_tokens`` that does not fit after the prompt in
        ``max_model_len`` (see :meth:`request_problem`; ``nanovllm-tui`` sends so, as the server and
        ``nanovllm`` refuse it). Off (the library's default, vLLM's ``LLM``): output is cut at
        ``max_model_len`` with ``finish_reason="length"``.

        ``arrival``: ``(engine time, paused seconds)`` from :meth:`EngineClock.reading` when a front end
        received the request on its own thread (``EngineController.submit``); TTFT and e2e latency count
        from it, the wait for the step running then included (vLLM's ``arrival_time``). None: now.

        A request the engine can never serve (text that is not valid Unicode, an empty prompt, one longer than
        ``max_model_len`` or needing more KV blocks than the whole pool, prompt or
        ``stop_token_ids`` or ``logit_bias`` ids outside the vocabulary, or any request after the device failed for
        good, see ``fatal_error``) is *rejected*: a ``RequestRejected`` event
        and, from the next :meth:`step`, a finished ``RequestOutput`` with
        ``finish_reason="rejected"`` and ``error`` set.

        Raises:
            ValueError: ``params`` is not a SamplingParams, ``priority`` not an int in
                ``[PRIORITY_MIN, PRIORITY_MAX]`` (-1000..1000) or, under ``scheduling_policy="fcfs"``, not 0
                (:meth:`check_priority`), or the id is in use.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        self.check_priority(priority)
        request_id = str(request_id) if request_id is not None else self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {untrusted.shown(request_id)} is already in use")
        if self.fatal_error is not None:
            return self._reject(request_id, prompt, [], self.fatal_error, params, priority)
        try:
            text, token_ids = self.encode_prompt(prompt)
        except ValueError as e:  # the prompt itself is not kept: it may not even be writable as UTF-8
            return self._reject(request_id, None, [], str(e), params, priority)
        problem = self.request_problem(token_ids, params, fit_context)
        if problem is not None:
            return self._reject(request_id, text, token_ids, problem[1], params, priority)
        n_prompt = len(token_ids)
        req = RequestState(request_id, text, token_ids, params)
        # arrival: (engine time, paused seconds) when a front end received it (EngineController.submit), so
        # TTFT and e2e count the wait for the step that was running then, as vLLM's do (trial 30c: 7.8 s left out)
        now, paused = arrival if arrival is not None else self.clock.reading()
        for i in range(params.n):
            seq = Sequence(seq_id=next(self._seq_counter), request_id=request_id, token_ids=list(token_ids),
                           num_prompt_tokens=n_prompt, params=params, prompt=text, index=i, priority=priority,
                           eos_token_ids=() if params.ignore_eos else self.eos_token_ids)
            seq.metrics.arrival_time, seq.metrics.paused_at_arrival = now, paused
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            if params.logprobs is not None:
                seq.logprobs = []
            start_detokenizer(seq)
            req.seqs.append(seq)
        self.requests[request_id] = req
        # Samples of one prompt share its blocks through the prefix cache: the siblings wait
        # until the first sample's prompt is cached. A prompt with no full block before the one holding
        # its last token (never a hit) has nothing to share: they run together (trial 29f: a 4-token
        # prompt's second sample waited a step for nothing).
        first, rest = req.seqs[0], req.seqs[1:]
        if rest and self.block_manager.enable_prefix_caching and self.shareable_prompt_blocks(n_prompt):
            req.pending_siblings = rest
            rest = []
        self.scheduler.add(first)
        for seq in rest:
            self.scheduler.add(seq)
        if self._subscribers:
            told = chat if chat is not None else prompt
            self._emit(ev.RequestAdded(
                request_id=request_id, prompt=text, prompt_token_ids=tuple(token_ids),
                prompt_pieces=tuple(self.token_pieces(token_ids)), priority=priority, max_tokens=params.max_tokens,
                n=params.n, sampling=tuple(sorted(_non_default(params).items())),
                chat=tuple((m["role"], content_text(m["content"])) for m in told) if is_conversation(told) else (),
            ))
        return request_id

    def shareable_prompt_blocks(self, num_prompt_tokens: int) -> int:
        """Full blocks of a prompt that another sample can find in the prefix cache: those before the
        block holding its last token (never a hit: each sample computes that token for its own scores)."""
        return (num_prompt_tokens - 1) // self.block_manager.block_size

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer has a chat template (an instruction-tuned model's prompt format)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_token_ids(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template.

        ``continue_final_message``: the last message is left open (no end-of-turn after it), so
        the model goes on with it (transformers' option, as vLLM passes it); it needs
        ``add_generation_prompt=False``. ``chat_template_kwargs``: extra variables the template
        sees (``{"enable_thinking": False}``; a template ignores those it does not use).

        Raises:
            ValueError: the tokenizer has no chat template, the options cannot go together
                (``prompts.chat_template_problem``), or the template refused the conversation.
        """
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send plain prompts instead of chat")
        problem = chat_template_problem(add_generation_prompt, continue_final_message, chat_template_kwargs)
        if problem is not None:
            raise ValueError(problem[1])
        try:
            # developer -> system and text parts joined, as the server sends them (prompts.template_message)
            conversation = [template_message(m) if isinstance(m, dict) else m for m in conversation]
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      tokenize=False, **(chat_template_kwargs or {}))
        except Exception as e:  # jinja2's errors: a template that refuses these messages
            raise ValueError(f"the chat template could not render these messages: {untrusted.clipped(str(e), 200)}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_pieces(self, token_ids: list[int]) -> list[str]:
        """The text of each token on its own (for showing tokenization): a token holding only part of
        a character's bytes as those bytes, ``<0xE3>`` (``detokenizer.TokenPieces``), not "�"."""
        return [self.output.pieces(t) for t in token_ids]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks are released (one another request shares stays in use). False if none such."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort", None)
        self._blocks_released()
        return True

    def _blocks_released(self) -> None:
        """Blocks were released outside a step's end (an abort, every live request failed): a watcher
        of the pool gets the new snapshot now, as a step's end sends one. Without it a paused engine's
        Block Map kept an aborted request's blocks until the next step (newcomer trial 18a)."""
        if self._blocks_wanted:
            self._emit(self.blocks_event(self.step_index))

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued or running, or a finished output has not been returned yet."""
        return bool(self.requests) or bool(self.output.pending)

    def pop_finished_outputs(self) -> list[RequestOutput]:
        """Outputs finished outside a step (rejections, aborts), returned once."""
        outputs, self.output.pending = self.output.pending, []
        return outputs

    def fail_running(self, reason: str) -> list[RequestOutput]:
        """Finish every live request with ``finish_reason="error"`` (after an unrecoverable step failure)."""
        for req in list(self.requests.values()):
            for seq in req.seqs:
                if not seq.is_finished:
                    self._finish(seq, "error", None, error=reason)
        self._blocks_released()
        return self.pop_finished_outputs()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return outputs of the requests it touched (finished ones have ``finished=True``).

        Schedule; run the model once over the whole batch; sample (plain decode rows and
        speculative verification rows through the one sampler); update every sequence
        (computed tokens, blocks, kept tokens and their stop checks); emit.
        """
        outputs, self.output.pending = self.output.pending, []
        if self.fatal_error is not None or not self.scheduler.has_unfinished():
            return outputs
        t0 = time.perf_counter()
        gate = yield_gate.GATE
        waited0 = gate.c.waited_ns  # a front end's hold (yield_gate.py): waited here and between layers
        if gate.c.until_ns:
            gate.wait()
        plan = self.scheduler.schedule()
        self.step_index = plan.step
        for seq in plan.preempted:
            self._release(seq.seq_id)
        touched: dict[str, None] = {}
        if plan.is_empty:
            if self._subscribers:
                self._emit(self._step_planned_event(plan))
            return outputs
        now = self.clock.now()
        for s in plan.scheduled:
            if s.seq.metrics.first_scheduled_time is None:
                s.seq.metrics.first_scheduled_time = now
        announced = False
        try:
            if self.speculator is not None:
                self.speculator.propose(plan.scheduled)  # drafts join the batch: the plan shows them
                plan.num_batched_tokens = sum(s.num_new_tokens for s in plan.scheduled)
            if self._subscribers:
                self._emit(self._step_planned_event(plan))
            announced = True
            if self.fault_injector is not None:
                self.fault_injector(plan)
            extra_rows = self.speculator.extra_rows(plan.scheduled) if self.speculator else None
            tracer = self._tracer(plan)
            self._step_traced = tracer is not None  # its capture counts in the step's time (StepTimed.traced)
            result = self.runner.run(plan.scheduled, tracer=tracer, extra_rows=extra_rows)
            sampled = self._sample(result)
            stamp = StepStamp.now(self.clock)  # every token and finish of this step carries it
        except Exception as e:  # isolate: retry each sequence alone, finish those that still fail
            if isinstance(e, TimeoutError):
                # a caller's time limit (signal.alarm's handler, a timeout library) is not a fault of
                # this step's requests: it reaches the caller, as Ctrl-C does; LLM.generate then aborts
                # the unfinished requests (trial 21c: the retries swallowed it and generate ran on)
                raise
            if isinstance(e, TensorParallelError) or is_fatal_device_error(e, self.device):
                outputs.extend(self._stop_after_device_error(plan.step, e))
                return outputs
            self._emit(ev.EngineError(step=plan.step, message=f"{type(e).__name__}: {e}",
                                      traceback=traceback.format_exc()))
            if not self._subscribers:  # said where a plain LLM.generate caller sees it: no one hears the event
                warnings.warn(f"step {plan.step} raised {type(e).__name__}: {untrusted.clipped(str(e), 200)}; each of "
                              f"its {len(plan.scheduled)} sequence(s) is retried alone and one that fails again finishes "
                              "with finish_reason 'error' (raise TimeoutError or KeyboardInterrupt to stop generate "
                              "instead)", RuntimeWarning, stacklevel=2)
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()  # what the failed batch held, before the smaller retries
            if self.speculator is not None:
                self.speculator.discard(plan.scheduled)  # retry as plain decodes
                plan.num_batched_tokens = sum(s.num_new_tokens for s in plan.scheduled)
            if self._subscribers and not announced:
                self._emit(self._step_planned_event(plan))
            for s in plan.scheduled:
                if s.seq.is_finished:
                    continue
                try:
                    result = self.runner.run([s])
                    sampled = self._sample(result)
                    self._update([s], result, sampled, plan.step, touched, StepStamp.now(self.clock))
                except Exception as e2:
                    self._emit(ev.EngineError(step=plan.step, message=f"{type(e2).__name__}: {e2}",
                                              request_id=s.seq.request_id, traceback=traceback.format_exc()))
                    self._finish(s.seq, "error", None, error=f"engine error: {type(e2).__name__}: {e2}")
                    touched[s.seq.request_id] = None
        else:
            self._update(plan.scheduled, result, sampled, plan.step, touched, stamp)
        if self.speculator is not None:
            self.speculator.step_done()
        self._note_waste(plan.step)
        if self._subscribers:
            yielded = (gate.c.waited_ns - waited0) / 1e9
            self._emit_step_end(plan, time.perf_counter() - t0 - yielded, yielded)
        outputs.extend(self.output.take(self.requests, touched))
        return outputs

    def _stop_after_device_error(self, step: int, error: Exception) -> list[RequestOutput]:
        """The device is unusable (see ``device_errors``): report it once, finish every live
        request with the error, and refuse new ones from now on."""
        first_line = (str(error).strip().splitlines() or [""])[0]
        self.fatal_error = (f"the {self.device.type} device failed ({type(error).__name__}: {first_line}); "
                            "the engine has stopped, restart it")
        if isinstance(error, TensorParallelError):  # the workers are already stopped (WorkerGroup.failure)
            self.fatal_error = f"{first_line}, restart it"
            self.runner.close()
        self._emit(ev.EngineError(step=step, message=self.fatal_error, traceback=traceback.format_exc()))
        return self.fail_running(self.fatal_error)

    def _sample(self, result: ForwardResult) -> SamplerOutput:
        """The tokens every sampling sequence keeps this step, all through one sampler.

        Logits row ``i`` of a scheduled sequence predicts the token after its first
        ``start + i + 1`` tokens. A plain sequence has one row; a speculating one has a row per
        draft plus one, grouped so that the sampler verifies the drafts.
        """
        rows, groups, prev = [], [], None
        for s, i in result.rows:
            rows.append(SamplingRow.at(s.seq, s.start + i + 1))
            if s is not prev:
                groups.append(self.speculator.row_group(s) if self.speculator else RowGroup())
                prev = s
        return self.sampler(result.logits, rows, self._topk_wanted, groups)

    def _update(self, scheduled: list[ScheduledSequence], result: ForwardResult, sampled: SamplerOutput,
                step: int, touched: dict[str, None], stamp: StepStamp) -> None:
        """Advance every scheduled sequence by what the step computed, then append its kept tokens.

        Kept tokens go through the output processor one by one, whether sampled or kept by a
        verification, so an EOS, stop string or ``max_tokens`` inside an accepted run ends the
        sequence there. ``stamp`` (when the forward pass and sampling finished) is the time of
        every kept token, of every request this ends and of the events sent about them.
        """
        groups, first = [], 0
        for n, v in zip(sampled.num_kept, sampled.verifications):
            groups.append((result.rows[sampled.rows[first]][0], first, n, v))
            first += n
        accepted = {id(s): v.num_accepted for s, _, _, v in groups if v is not None}
        for s in scheduled:
            self._advance(s, accepted.get(id(s), 0), touched)
        emit, topk = (self._emit, self._topk_wanted) if self._subscribers else (None, 0)
        for s, first, n, v in groups:
            seq = s.seq
            if v is not None:
                self.speculator.record(v)
                if emit is not None:
                    emit(ev.SpecDecodeStep(
                        step=step, request_id=seq.request_id, seq_id=seq.seq_id, proposer=self.speculator.name,
                        draft_tokens=tuple(s.spec_tokens), draft_texts=tuple(self.token_pieces(s.spec_tokens)),
                        p=tuple(v.p), q=tuple(v.q), accepted=tuple(v.accepted), bonus_token=v.tokens[-1],
                        bonus_text=self.output.pieces(v.tokens[-1]), greedy=v.greedy,
                        num_query_tokens=s.num_new_tokens, time=stamp.wall_s,
                    ))
            for i in range(first, first + n):
                stop = self.output.append_token(seq, sampled, i, step, speculative=v is not None, emit=emit, topk=topk,
                                                stamp=stamp)
                if stop is not None:
                    self._finish(seq, *stop, stamp=stamp)
                    break

    def _advance(self, s: ScheduledSequence, num_accepted: int, touched: dict[str, None]) -> None:
        """Mark the tokens ``s`` ran as computed, all but rejected drafts; hash newly full blocks.

        A speculating sequence rolls back to its accepted drafts: the rejected ones leave
        ``token_ids``, blocks past the kept tokens return to the pool, and only blocks of kept
        tokens get prefix-cache hashes. Its drafts then leave ``token_ids`` too: the kept
        tokens are appended again with their stop checks.
        """
        seq = s.seq
        seq.num_computed_tokens = s.start + s.num_new_tokens - (len(s.spec_tokens) - num_accepted)
        if s.spec_tokens:
            del seq.token_ids[seq.num_computed_tokens:]
            self.block_manager.truncate(seq, seq.num_computed_tokens)
        # The accepted run's K/V is valid even if a stop cuts the run short: hash it now.
        self._cache_full_blocks(seq)
        if s.spec_tokens:
            del seq.token_ids[s.start + 1:]
        touched[seq.request_id] = None
        if not seq.in_prefill and seq.num_computed_tokens >= seq.num_prompt_tokens:
            self._release_siblings(seq)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        limit = self.speculator.computed_tokens(seq) if self.speculator else None
        self.block_manager.cache_full_blocks(seq, limit)

    def _release(self, seq_id: int) -> None:
        """Drop per-sequence state outside the block manager (contiguous cache, draft bookkeeping)."""
        self.runner.release(seq_id)
        if self.speculator is not None:
            self.speculator.release(seq_id)

    def _release_siblings(self, seq: Sequence) -> None:
        req = self.requests.get(seq.request_id)
        if req is not None and req.pending_siblings:
            for sib in req.pending_siblings:
                self.scheduler.add(sib)
            req.pending_siblings = []

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None, error: str | None = None,
                stamp: StepStamp | None = None) -> None:
        """End ``seq`` and release its blocks; the request's last sample ending sends ``RequestFinished``.

        ``stamp``: the step whose token ended it (its finish time and the event's); None (an
        abort, an error outside a step's output): now.
        """
        stamp = stamp or StepStamp.now(self.clock)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error = error
        seq.metrics.finished_time = stamp.engine_s
        seq.metrics.paused_time = self.clock.paused_s() - seq.metrics.paused_at_arrival
        seq.metrics.finished_step = self.step_index
        self.scheduler.remove(seq)
        self._release(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        req = self.requests.get(seq.request_id)
        if req is not None and seq in req.pending_siblings:
            req.pending_siblings.remove(seq)
        elif req is not None and req.pending_siblings and reason != "abort":
            # The first sample ended (an engine error) before its prompt was cached: the
            # waiting samples must still run rather than be left behind.
            self._release_siblings(seq)
        if req is not None and all(s.is_finished for s in req.seqs):
            del self.requests[seq.request_id]
            self._ended(seq.request_id)
            self.output.finished(req)
            if self._subscribers:
                self._emit(self._finished_event(req, stamp.wall_s))

    # ------------------------------------------------------------------ statistics

    @property
    def prefix_cache_hit_rate(self) -> float:
        bm = self.block_manager
        return bm.prefix_cache_hits / bm.prefix_cache_queries if bm.prefix_cache_queries else 0.0

    def _slots_wasted(self) -> int:
        """Slots allocated to live sequences and not (yet) filled with keys and values: a sequence's
        newest sampled token has none until the next step computes it (trial 23a: counted as filled,
        the figure was one a sequence below the narrator's and the Block Map's)."""
        bs = self.block_manager.block_size
        return sum(len(s.block_table) * bs - min(s.num_computed_tokens, len(s.block_table) * bs)
                   for s in self.scheduler.running + self.scheduler.waiting)

    def _note_waste(self, step: int) -> None:
        """Keep the most slots ever allocated but unfilled at a step's end (``stats``' peak): the
        figure at the end of a run is 0, when every request has released its blocks, so the waste
        a layout costs (the contiguous baseline's reservations) shows only as this peak (trial 22b)."""
        wasted = self._slots_wasted()
        if wasted > self._waste_peak[0]:
            self._waste_peak = (wasted, step)

    def stats(self) -> dict[str, Any]:
        """Counters of the engine's life so far (blocks, prefix cache, preemptions, steps).

        The pool's blocks in three parts that add up to ``kv_blocks_total``: ``kv_blocks_used``
        (held by live requests), ``kv_blocks_cached`` (free, still holding a cached prefix a later
        prompt can hit) and ``kv_blocks_free`` (free, holding nothing; the CLI's and the app's
        "free"). ``kv_slots_wasted``: slots allocated to live sequences but not (yet) filled with keys
        and values (the narrator's and the Block Map's count);
        ``kv_slots_wasted_peak``: the most there were at any step's end so far, and
        ``kv_slots_wasted_peak_step`` that step (None before any); ``kv_cache_usage``: used blocks / total (0..1).
        """
        bm = self.block_manager
        return {
            "steps": self.scheduler.step_index,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_caching": bm.enable_prefix_caching,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks - bm.num_cached_free_blocks,
            "kv_blocks_cached": bm.num_cached_free_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            "kv_slots_wasted": self._slots_wasted(),
            "kv_slots_wasted_peak": self._waste_peak[0],
            "kv_slots_wasted_peak_step": self._waste_peak[1],
            "kv_bytes_per_block": self.bytes_per_block,
            "kv_bytes_total": bm.num_blocks * self.bytes_per_block,
            "block_size": bm.block_size,
            # the KV byte figures above are the whole pool's, over every rank (each holds 1/N: its KV heads)
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "total_prompt_tokens": self.output.total_prompt_tokens,  # per sample, at its first token (vLLM's count)
            "total_output_tokens": self.output.total_output_tokens,
            "spec_proposer": self.speculator.name if self.speculator else None,
            "spec_num_speculative_tokens": self.speculator.k if self.speculator else 0,
            **(self.speculator.stats if self.speculator else SpecDecodeStats()).as_dict(),
        }


def _non_default(params: SamplingParams) -> dict[str, Any]:
    default = SamplingParams()
    out = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "min_tokens", "ignore_eos", "logprobs", "n"):
        value = getattr(params, name)
        if value != getattr(default, name):
            out[name] = value
    if params.stop:
        out["stop"] = tuple(params.stop)
    if params.logit_bias:  # (token id, bias) pairs: hashable, and JSON in a trace
        out["logit_bias"] = tuple(sorted(params.logit_bias.items()))
    return out

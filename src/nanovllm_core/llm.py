"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``.

Moving a script to vLLM is a change of import::

    from nanovllm_core import LLM, SamplingParams     # here
    from vllm import LLM, SamplingParams              # there
"""

from __future__ import annotations

import sys
from typing import Any, Sequence as Seq

from nanovllm_core.config import EngineConfig, check_flag
from nanovllm_core.engine.llm_engine import EngineDeadError, LLMEngine
from nanovllm_core.model.loader import ProgressFn, check_progress
from nanovllm_core.outputs import RequestOutput
from nanovllm_core.prompts import chat_template_problem, conversation_problem, describe
from nanovllm_core.sampling_params import SamplingParams


def console_progress() -> ProgressFn:
    """A progress callback that draws one tqdm bar per stage on stderr (used while converting GGUF).

    Its ``close()`` clears the bars still drawn: a load that fails mid-stage calls it before its error
    line, which would otherwise start on the bar's line (``LLM.__init__`` does, through :func:`close_progress`).
    """
    from tqdm.auto import tqdm

    bars: dict[str, Any] = {}

    def close() -> None:
        for bar in bars.values():
            bar.close()  # closing twice is harmless

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            if (done >= total or total <= 1) and stage != "converting GGUF":
                return  # nothing worth drawing for a one-shot stage (a 0/1 bar says no more than its end)
            bar = bars[stage] = tqdm(total=total, desc=stage, file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    progress.close = close
    return progress


def close_progress(progress: Any) -> None:
    """Clear what a progress callback still draws (its ``close()``, when it has one)."""
    close = getattr(progress, "close", None)
    if callable(close):
        close()


CLOSED = "this LLM is closed; create a new LLM(...)"  # what generate and chat raise after close()


class LLM:
    """Load a model once and generate for batches of prompts.

    Args:
        model: a Hugging Face repo id, a local folder, a ``.gguf`` file, or None for the
            embedded default (SmolLM2-135M-Instruct).
        device, dtype, and every :class:`EngineConfig` field as keyword arguments
            (``block_size``, ``num_kv_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``scheduling_policy``, ``enable_prefix_caching``, ``paged``, ``speculative_model``,
            ``num_speculative_tokens``, ``tensor_parallel_size``, ...). With ``tensor_parallel_size=N``
            (N > 1) N-1 worker processes hold the other shards; :meth:`close` (or ``with``) stops them.
        progress: loading progress callback ``progress(stage, done, total)`` (:data:`ProgressFn`; None: a
            console bar while converting); anything else is refused at once (:func:`check_progress`).

    After :meth:`close` (or the end of a ``with`` block) it refuses new work: ``generate`` and
    ``chat`` raise ``ValueError(CLOSED)``, as a closed file refuses a read; ``stats``, the tokenizer
    and ``apply_chat_template`` still answer (they run nothing).

    Raises:
        ModelLoadError: the model cannot be found or loaded.
        ValueError: an invalid engine setting, or an unknown keyword argument.
    """

    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None,
                 progress: ProgressFn | None = None, **engine_kwargs: Any) -> None:
        self._closed = False
        unknown = EngineConfig.unknown_options(engine_kwargs, "LLM", extra=("progress",))
        if unknown:
            raise ValueError(unknown)
        check_progress(progress)  # before the load that would call it
        self.config = EngineConfig(model=model, device=device, dtype=dtype, **engine_kwargs)
        progress = progress or console_progress()
        try:
            self.engine = LLMEngine.from_config(self.config, progress=progress)
        finally:  # a failed load's error line must not start on a half-drawn bar
            close_progress(progress)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine built elsewhere (tests, the controller)."""
        self = cls.__new__(cls)
        self._closed = False
        self.config = engine.config
        self.engine = engine
        return self

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the model."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        priority: list[int] | None = None,
        use_tqdm: bool = True,
        *,
        reject_bad_prompts: bool = False,
        conversations: list[list[dict[str, Any]]] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``; outputs come back in input order.

        Args:
            prompts: one string, a list of strings, or a list of token-id lists; vLLM's prompt dicts
                (``{"prompt": text}``, ``{"prompt_token_ids": ids}``) are taken for either.
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
            priority: one integer per prompt, -1000 to 1000 (``PRIORITY_MIN``..``PRIORITY_MAX``; higher runs
                first under the priority policy; vLLM's ``priority`` is the opposite, lower first, and its
                default policy is ``fcfs``). Under ``scheduling_policy="fcfs"`` only 0, as vLLM refuses
                any other there (``LLMEngine.check_priority``).
            use_tqdm: show a progress bar on stderr when there are several prompts and stderr is a terminal.
            reject_bad_prompts: not vLLM's; True returns a prompt the engine cannot take finished with
                ``finish_reason == "rejected"`` and ``error`` set while the rest run (what ``nanovllm``'s
                command line uses to report each bad prompt), instead of raising.
            conversations: not vLLM's; one conversation per prompt, where the caller rendered each prompt
                from it with :meth:`apply_chat_template` (``nanovllm --chat``): the teaching views then tell
                the prompt as that conversation put through the chat template (``LLMEngine.add_request``'s
                ``chat``). It changes nothing generated. ValueError when its length is not the prompts'.

        A prompt the engine could never serve (``LLMEngine.encode_prompt`` and ``request_problem``:
        empty, not valid Unicode, token ids outside the vocabulary, too long for ``max_model_len``,
        more KV blocks than the pool, ``n`` above ``max_num_seqs``, ``stop_token_ids`` outside the
        vocabulary) raises before any prompt is queued, as vLLM's ``LLM.generate`` does, so nothing
        is half-done. A ``max_tokens`` beyond what the context leaves is not an error here (unlike
        the server, which refuses it as vLLM's does): generation stops when prompt plus output
        reach ``max_model_len``, with ``finish_reason == "length"``.

        When the engine stops for good during this call (a tensor-parallel worker died, hung or failed;
        the device failed), the call returns: every request that was not done finishes with
        ``finish_reason == "error"`` and the one-line reason in ``RequestOutput.error`` (check it: the
        text is cut short), every KV block freed. Every later call raises :class:`EngineDeadError`
        with that reason.

        Raises:
            ValueError: this LLM was closed (:data:`CLOSED`), before anything else is looked at.
            EngineDeadError: the engine stopped for good in an earlier call (its reason, one line).
            ValueError: ``prompts`` of another type (None, a number, a dict; a token-id list holding
                something other than ints), naming what was given; sampling_params or priority lists
                of the wrong length or type, a priority that is not a list or tuple (one int: ``[3]``), a priority
                outside -1000..1000 or not 0 under ``scheduling_policy="fcfs"``, or a prompt the engine cannot take (one line naming it,
                ``prompts[i]`` when prompts is a list, even of one); all checked before any prompt is queued.
        """
        self._check_open()
        prompt_list = self._prompt_list(prompts)
        if conversations is not None and (not isinstance(conversations, (list, tuple))
                                          or len(conversations) != len(prompt_list)):
            raise ValueError(f"conversations must be a list with one conversation per prompt ({len(prompt_list)}), "
                             f"got {describe(conversations)}")
        return self._generate(prompt_list, sampling_params, priority, use_tqdm,
                              reject_bad_prompts, label="prompts[{i}]" if self._is_batch(prompts) else None,
                              chats=conversations)

    def _check_open(self) -> None:
        """Raise ValueError(:data:`CLOSED`) once :meth:`close` has run, and :class:`EngineDeadError` once the
        engine has stopped for good (``LLMEngine.fatal_error``): neither takes new work."""
        if getattr(self, "_closed", False):
            raise ValueError(CLOSED)
        engine = getattr(self, "engine", None)
        if engine is not None and engine.fatal_error is not None:
            raise EngineDeadError(engine.fatal_error)

    def _generate(
        self,
        prompts: list[Any],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        priority: list[int] | None,
        use_tqdm: bool,
        reject_bad_prompts: bool,
        label: str | None,
        noun: str = "prompts",
        chats: list[Any] | None = None,
    ) -> list[RequestOutput]:
        """``generate``'s body over a list of prompts; ``label`` names the i-th prompt in a refusal
        (``"prompts[{i}]"`` for ``generate``, ``"conversation {i}"`` for ``chat``; None when the caller
        gave one prompt, not a list of them, so there is no index to name) and ``noun`` all of them
        (``"prompts"``, ``"conversations"``); ``chats``: the conversation each prompt was rendered from, for
        the teaching views (``LLMEngine.add_request``'s ``chat``), or None."""
        check_flag("use_tqdm", use_tqdm)  # 'no' would be read as true; vLLM's tqdm factory is not taken either
        check_flag("reject_bad_prompts", reject_bad_prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                many = noun if len(prompts) != 1 else noun[:-1]
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} {many}; give one or "
                                 f"one per {noun[:-1]}")
            params_list = list(sampling_params)
            for i, sp in enumerate(params_list):
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, not {type(sp).__name__}")
        else:
            if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
                raise ValueError("sampling_params must be a SamplingParams or a list of them (one per "
                                 f"{noun[:-1]}), not {type(sampling_params).__name__}")
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)):  # an int, a string, a dict, a generator: not one per prompt
            one = f"; for one {noun[:-1]} give [{priority!r}]" if type(priority) is int and len(prompts) == 1 else ""
            raise ValueError(f"priority must be a list of whole numbers, one per {noun[:-1]}, got "
                             f"{describe(priority)}{one}")
        elif len(priority) != len(prompts):
            many = noun if len(prompts) != 1 else noun[:-1]
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} {many}; give one per {noun[:-1]}")
        for i, prio in enumerate(priority):  # all checked before any is queued: none is left behind half-added
            self.engine.check_priority(prio, f"priority[{i}]")
        engine = self.engine
        if not reject_bad_prompts:
            for i, (p, sp) in enumerate(zip(prompts, params_list)):
                problem = self.prompt_problem(p, sp)
                if problem is not None:
                    raise ValueError(f"{label.format(i=i)}: {problem}" if label is not None else problem)
        chats = list(chats) if chats is not None else [None] * len(prompts)
        ids = [engine.add_request(p, sp, prio, chat=c) for p, sp, prio, c in zip(prompts, params_list, priority, chats)]
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        # Only on a terminal: written to a file or a pipe, the bar's last redraw (leave=False) is a
        # line of spaces among the output (issue 29).
        if use_tqdm and len(prompts) > 1 and sys.stderr.isatty():
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generating", file=sys.stderr, leave=False)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted and out.request_id not in results:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:  # leave no request (and no KV block) behind on Ctrl-C
                if rid not in results:
                    engine.abort_request(rid)
            engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    @staticmethod
    def _is_batch(prompts: Any) -> bool:
        """Whether ``prompts`` is a list of prompts (``["a"]``, ``[[1, 2]]``; its refusals name
        ``prompts[i]``, also for a list of one) rather than one prompt (a text, one token-id list, one dict)."""
        return isinstance(prompts, (list, tuple)) and not (
            prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool))

    @staticmethod
    def _prompt_list(prompts: Any) -> list[Any]:
        """``prompts`` as a list of prompts: one text or one token-id list becomes a list of one.

        Raises:
            ValueError: not a string or a list/tuple (None, a number, a dict), or a list that starts
                as token ids (an int first) but holds something else; one line naming what was given.
                A list of prompts may mix texts, token-id lists and conversations: each is encoded
                and checked on its own.
        """
        shape = ("prompts must be a string, a list of token ids, or a list of prompts (strings, token-id lists, "
                 "{'prompt': ...} / {'prompt_token_ids': ...} dicts or conversations)")
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, dict) and ("prompt" in prompts or "prompt_token_ids" in prompts):
            return [LLM._vllm_prompt(prompts, "prompts")]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"{shape}, got {describe(prompts)}")
        if prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
            for i, t in enumerate(prompts):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(f"prompts starts as one token-id list but prompts[{i}] is {describe(t)}; "
                                     f"{shape}, got {describe(prompts)}")
            return [list(prompts)]
        return [LLM._vllm_prompt(p, f"prompts[{i}]") if isinstance(p, dict) else p for i, p in enumerate(prompts)]

    @staticmethod
    def _vllm_prompt(prompt: dict, where: str) -> Any:
        """vLLM's ``TextPrompt`` / ``TokensPrompt`` dict as this engine's prompt: ``{"prompt": text}``
        -> text, ``{"prompt_token_ids": ids}`` -> ids (trial 11: both were refused as "a dict").

        Raises:
            ValueError: neither key, both, or a key this engine does not take (``multi_modal_data``,
                ``cache_salt``, ...), named.
        """
        known = {"prompt", "prompt_token_ids"}
        if "role" in prompt or "content" in prompt:
            raise ValueError(f"{where} is a chat message; a conversation is a list of them: "
                             "generate([conversation]) or chat(conversation)")
        other = sorted(k for k in prompt if k not in known) if all(isinstance(k, str) for k in prompt) else ["?"]
        if other:
            raise ValueError(f"{where} has {', '.join(map(repr, other))}: a prompt dict here takes 'prompt' (text) or "
                             "'prompt_token_ids' (a list of token ids) only")
        if len(prompt) != 1:
            raise ValueError(f"{where} must hold one of 'prompt' or 'prompt_token_ids', got "
                             f"{' and '.join(map(repr, sorted(prompt))) or 'an empty dict'}")
        value = next(iter(prompt.values()))
        if "prompt" in prompt and not isinstance(value, str):
            raise ValueError(f"{where}['prompt'] must be text, got {describe(value)}")
        if "prompt_token_ids" in prompt:
            if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in value):
                raise ValueError(f"{where}['prompt_token_ids'] must be a list of token ids, got {describe(value)}")
            return list(value)
        return value

    def prompt_problem(self, prompt: Any, params: SamplingParams) -> str | None:
        """Why the engine would reject ``prompt`` with ``params`` (its one-line reason); None when it can run.

        The same checks ``LLMEngine.add_request`` rejects by (``encode_prompt``, then ``request_problem``),
        asked before anything is queued.
        """
        try:
            _, token_ids = self.engine.encode_prompt(prompt)
        except ValueError as e:
            return str(e)
        problem = self.engine.request_problem(token_ids, params)
        return None if problem is None else problem[1]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate.

        ``continue_final_message`` (with ``add_generation_prompt=False``, vLLM's rule) leaves the
        last message open for the model to go on with; ``chat_template_kwargs`` are extra
        variables for the template (vLLM's ``LLM.chat`` arguments; ``LLMEngine.chat_token_ids``).

        Each message is ``{"role": ..., "content": text}`` with a role the server takes too
        (``prompts.CHAT_ROLES``: system, developer, user, assistant, tool; developer reaches the
        template as system). ``content`` may also be a list of text parts
        (``[{"type": "text", "text": ...}]``), joined by newlines into one text as the server and vLLM join them
        (``prompts.content_text``); any other part (an image) is refused, as the server refuses it.

        Raises:
            EngineDeadError: the engine stopped for good in an earlier call (its reason, one line).
            ValueError: this LLM was closed (:data:`CLOSED`); ``messages of another type (a str,
                None, a dict alone, a list of strings; the message names what was given), no
                conversation, a message that is not such a dict or has another role or a non-text
                content part, the tokenizer has no chat template, or a prompt ``generate`` refuses;
                all checked before any conversation is queued.
        """
        self._check_open()
        shape = "messages must be a list of {'role', 'content'} dicts (or a list of such lists)"
        if isinstance(messages, (list, tuple)) and not messages:
            raise ValueError("messages is empty; give a conversation (a list of {'role': ..., 'content': text}) "
                             "or a list of them")
        if isinstance(messages, dict):
            raise ValueError(f"{shape}, got a dict; put one message in a list: [message]")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"{shape}, got {describe(messages)}")
        batch = not isinstance(messages[0], dict)  # a list of conversations: refusals name conversation i
        if isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages[0], (list, tuple)):
            conversations = list(messages)
        else:
            raise ValueError(f"{shape}, got {describe(messages)}")
        for i, conversation in enumerate(conversations):
            problem = conversation_problem(conversation)
            if problem is not None:
                raise ValueError(f"conversation {i}: {problem}" if batch else problem)
        problem = chat_template_problem(add_generation_prompt, continue_final_message, chat_template_kwargs)
        if problem is not None:  # before any conversation is queued
            raise ValueError(problem[1])
        prompts = [self.apply_chat_template(c, add_generation_prompt, continue_final_message, chat_template_kwargs)
                   for c in conversations]
        # a refusal names the conversation given, as the shape checks above do (not prompts[i]; trial 9)
        return self._generate(prompts, sampling_params, None, use_tqdm, False,
                              label="conversation {i}" if batch else None,
                              noun="conversations", chats=conversations)

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (options: :meth:`chat`).

        Raises:
            ValueError: the tokenizer has no chat template, options that cannot go together, or a
                template that refuses the conversation.
        """
        return self.engine.chat_token_ids(conversation, add_generation_prompt, continue_final_message,
                                          chat_template_kwargs)

    def close(self) -> None:
        """End this LLM: later ``generate`` and ``chat`` calls raise ``ValueError(CLOSED)``; the
        tensor-parallel workers (``tensor_parallel_size`` > 1) are stopped and the process group
        destroyed. With one process nothing else is released: the weights and the KV pool go when
        the object is garbage-collected. Idempotent; also run by ``with LLM(...) as llm:``, at
        garbage collection and at interpreter exit."""
        self._closed = True
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def stats(self) -> dict[str, Any]:
        """Engine counters: preemptions, prefix-cache hits, KV block use, steps (see ``LLMEngine.stats``)."""
        return self.engine.stats()

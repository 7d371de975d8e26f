"""``/v1/completions`` and ``/v1/chat/completions``: engine outputs -> OpenAI's response shapes.

A request is tokenized here to check it before any answer starts: every rule the engine
refuses by (``LLMEngine.request_problem``; the length against ``max_model_len`` with vLLM's
message), so a streamed request gets the same 400 as a whole one. Then it goes to the
controller as one engine request per prompt, and its outputs come back through a :class:`RequestStream`. Non-streaming requests get one
JSON body when every output has finished; streaming ones get server-sent events laid out as
vLLM's: a chat stream opens with a role chunk per choice, then one chunk (holding one choice)
whenever a choice's text grows (cumulative outputs become deltas here), ``data: [DONE]`` last.

Engine ``finish_reason`` values pass through: ``stop``, ``length``, and ``abort`` (vLLM's
word for a request cancelled before its end). Once a stream has begun, only an engine error
(or a device that failed meanwhile) comes as an ``{"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from nanovllm_core.engine.detokenizer import TokenBytes
from nanovllm_core.prompts import unicode_problem
from nanovllm_core.entrypoints.protocol import (MESSAGE_NULLS, APIError, ChatCompletionRequest, CompletionRequest,
                                                check_length)
from nanovllm_core.entrypoints.request_stream import InFlight, OutputRouter, RequestIds, RequestStream
from nanovllm_core.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm_core.untrusted import SHOWN_CHARS, clipped, encodable, has_lone_surrogate, shown


# what a client does about a priority the server's fcfs policy refuses (LLMEngine.check_priority's fix)
SERVER_FCFS_FIX = "send priority 0, or start the server with --scheduling-policy priority"


@dataclass
class _Choice:
    """What a streaming client has been sent of one choice: characters, tokens, whether it ended."""

    chars: int = 0
    tokens: int = 0
    offset: int = 0  # text_offset of the next token: the characters of the tokens sent so far
    started: bool = False
    done: bool = False


@dataclass
class Prepared:
    """A checked request, ready to submit: its prompts, params and what the response needs."""

    kind: str  # "completion" or "chat"
    request_id: str
    prompts: list[str | list[int]]
    params: Any
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_ids: list[list[int]] = field(default_factory=list)  # each prompt's token ids, as checked
    conversation: list[dict[str, Any]] | None = None  # a chat's messages, rendered into prompts[0]; told by the views
    engine_ids: list[str] = field(default_factory=list)  # reserved by OpenAIServing.reserve; one per prompt
    submitted: bool = False  # open_stream ran: the engine ids are released as their requests finish


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` as JSON (or the literal ``[DONE]``); a lone surrogate in
    any of its texts is written as its escape text (``untrusted.encodable``), so the event always encodes
    as UTF-8 (an error event repeating a client's ``"\\udc00"`` key cannot cut the stream; trial 29b)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if has_lone_surrogate(text):
        text = json.dumps(encodable(data), ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class OpenAIServing:
    """Answers completions and chat requests from one controller.

    Args:
        controller: the ``EngineController`` (its ``engine`` gives the tokenizer and limits).
        model_name: the name clients must send as ``model`` (or leave out).
        metrics: gets every finished output (``ServerMetrics.observe``); may be None.
        registry: the server's in-flight streams (ended at shutdown).
    """

    def __init__(self, controller: Any, model_name: str, metrics: Any = None, registry: InFlight | None = None) -> None:
        from nanovllm_core.llm import LLM

        self.controller = controller
        self.model_name = model_name
        self.metrics = metrics
        self.registry = registry if registry is not None else InFlight()
        self.ids = RequestIds()  # every engine request id in flight, the control API's too
        engine = controller.engine
        self._llm = LLM.from_engine(engine)  # the offline API's chat template path, read-only here
        self.tokenizer = engine.tokenizer
        self.token_bytes = TokenBytes(engine.tokenizer)
        self.max_model_len = engine.max_model_len
        self._router: OutputRouter | None = None

    # ------------------------------------------------------------------ checking

    def check_model(self, model: str | None) -> None:
        """Raises: APIError (404, as OpenAI and vLLM's ``_check_model`` answer) when ``model`` names another model.

        No ``model``, ``null`` and ``""`` all mean the served model (vLLM's ``_is_model_supported``
        starts ``if not model_name: return True``; UIs send ``""`` when no model is picked)."""
        if model and model != self.model_name:
            raise APIError(f"The model `{clipped(model, SHOWN_CHARS)}` does not exist; this server serves "
                           f"`{self.model_name}` (GET /v1/models lists it)", status=404, param="model",
                           code="model_not_found")

    def check_priority(self, priority: object) -> None:
        """The engine's rule for ``priority`` (``LLMEngine.check_priority``: -1000 to 1000, and 0 only
        under ``--scheduling-policy fcfs``, as vLLM's server refuses it), checked before any answer starts.

        Raises:
            APIError: 400 with param ``priority``.
        """
        try:
            self._llm.engine.check_priority(priority, fix=SERVER_FCFS_FIX)
        except ValueError as e:
            raise APIError(str(e), param="priority", code="invalid_value") from None

    def check_prompt(self, prompt: str | list[int], params: Any, names: dict[str, str] | None = None,
                     prompt_field: str = "prompt") -> list[int]:
        """Everything the engine would refuse ``prompt`` for, checked before any answer starts, so
        a streamed request gets the same 400 as a whole one. Returns the prompt's token ids.
        ``names``: the request field behind each ``SamplingParams`` field named otherwise
        (:meth:`APIError.renamed`), so the error names what the client sent; ``prompt_field``: the
        field that gave the prompt (``messages`` for a chat), named as ``param`` where the prompt is at fault.

        Raises:
            APIError: 400 naming the field (text that is not valid Unicode, an empty prompt, a
                token id outside the vocabulary, too long for the context, stop_token_ids outside
                the vocabulary, more KV blocks than the pool has); 503 when the engine failed for good.
        """
        try:
            return self._check_prompt(prompt, params, names)
        except APIError as e:
            if e.param == "prompt" and prompt_field != "prompt":
                e.param = prompt_field
            raise

    def _check_prompt(self, prompt: str | list[int], params: Any, names: dict[str, str] | None) -> list[int]:
        engine = self._llm.engine
        if engine.fatal_error is not None:
            raise APIError(engine.fatal_error, status=503, type="server_error", code="engine_dead")
        try:
            _, ids = engine.encode_prompt(prompt)
        except ValueError as e:
            raise APIError(str(e), param="prompt", code="invalid_value") from None
        vocab = engine.model_config.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:  # trial 18b: name the id and where it is, as the library does
            raise APIError(f"prompt holds a token id outside the vocabulary (0..{vocab - 1}): {shown(ids[bad])} at "
                           f"position {bad}", param="prompt", code="invalid_value")
        if not ids:
            raise APIError("prompt is empty; send at least one token of text", param="prompt", code="invalid_value")
        try:
            check_length(len(ids), params.max_tokens, self.max_model_len)
        except APIError as e:
            raise e.renamed(names) from None
        problem = engine.request_problem(ids, params)
        if problem is not None:
            raise APIError(problem[1], param=problem[0], code="invalid_value").renamed(names)
        return ids

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        """Check a completions request. Raises: APIError (400) naming what is wrong."""
        self.check_model(req.model)
        self.check_priority(req.priority)
        params = req.to_sampling_params()
        prompts = req.prompts()
        batch = not (isinstance(req.prompt, str) or isinstance(req.prompt[0], int))  # a list of prompts
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.check_prompt(p, params))
            except APIError as e:  # name which prompt of the list, as LLM.generate's prompts[i] does
                if batch and e.status == 400:
                    e.message = f"prompt[{i}]: {e.message}"
                    e.args = (e.message,)
                raise
        return Prepared("completion", f"cmpl-{uuid.uuid4().hex}", prompts, params, req.priority, req.stream,
                        *_usage_options(req), req.return_token_ids, prompt_ids=ids)

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        """Check a chat request and render its messages with the chat template. Raises: APIError (400)."""
        self.check_model(req.model)
        self.check_priority(req.priority)
        params = req.to_sampling_params()
        conversation = req.conversation()
        options = req.template_options()
        try:
            ids = self._llm.apply_chat_template(conversation, **options)
        except APIError:
            raise
        except ValueError as e:  # the engine's one line (no template, options that clash, or the template's refusal)
            raise APIError(clipped(str(e), 300), param="messages", code="invalid_value") from None
        except Exception as e:  # anything else the template raised
            raise APIError(f"the chat template could not render these messages: {clipped(str(e), 200)}", param="messages", code="invalid_value") from None
        self.check_prompt(ids, params, req.field_names(), prompt_field="messages")
        return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", [ids], params, req.priority, req.stream,
                        *_usage_options(req), req.return_token_ids, prompt_ids=[list(ids)],
                        conversation=conversation)

    def reserve(self, p: Prepared, client_id: str | None = None, client_field: str = "X-Request-Id") -> None:
        """Give ``p`` its ids and reserve them until its requests finish: ``cmpl-{client_id}`` /
        ``chatcmpl-{client_id}`` for an ``X-Request-Id`` header or a body's ``request_id``
        (``client_field`` names which, for the error; vLLM's ``_base_request_id``), else
        the server's own; one engine id per prompt (``{id}-{i}`` for several). Call
        :meth:`release_unsubmitted` when the response ends (ids never submitted are freed then).

        Raises:
            APIError: 400 (``duplicate_request_id``) when a request in flight holds one of the ids.
        """
        prefix = "chatcmpl" if p.kind == "chat" else "cmpl"
        while True:
            base = f"{prefix}-{client_id}" if client_id is not None else p.request_id
            ids = [base] if len(p.prompts) == 1 else [f"{base}-{i}" for i in range(len(p.prompts))]
            taken = self.ids.reserve(ids)
            if taken is None:
                p.request_id, p.engine_ids = base, ids
                return
            if client_id is not None:
                raise APIError(f"{client_field} {json.dumps(client_id)} gives the request id {json.dumps(taken)}, which is already in use "
                               "by a request that has not finished; choose another", param=client_field,
                               code="duplicate_request_id")
            p.request_id = f"{prefix}-{uuid.uuid4().hex}"  # the server's own id met a client's: draw again

    def release_unsubmitted(self, p: Prepared) -> None:
        """The response is over: free ``p``'s ids if its requests were never submitted (a client
        gone before a stream began); submitted ones are freed as each request finishes."""
        if not p.submitted:
            p.submitted = True
            self.ids.release(*p.engine_ids)

    def _finished(self, output: RequestOutput) -> None:  # engine thread
        self.ids.release(output.request_id)
        if self.metrics is not None:
            self.metrics.observe(output)

    def open_stream(self, p: Prepared) -> RequestStream:
        if self._router is None:  # made on first use, on the server's event loop
            self._router = OutputRouter(asyncio.get_running_loop())
        if not p.engine_ids:  # not reserved by the caller (a test's Prepared): reserve the server's id
            self.reserve(p)
        stream = RequestStream(self.controller, self._router, on_finished=self._finished, registry=self.registry,
                               on_progress=self.metrics.progress if self.metrics is not None else None)
        p.submitted = True
        stream.submit(p.prompts, p.params, p.priority, p.request_id, chat=p.conversation)
        return stream

    # ------------------------------------------------------------------ whole responses

    async def full_response(self, p: Prepared, stream: RequestStream) -> dict[str, Any]:
        """Wait for every output; the response body. Raises: APIError (refused or failed)."""
        final: dict[str, RequestOutput] = {}
        async for outputs in stream:
            for o in outputs:
                if o.finished:
                    final[o.request_id] = o
        if stream.ended_early:
            raise APIError("the server is shutting down; this request was aborted", status=503, type="server_error",
                           code="shutting_down")
        outs = [final[rid] for rid in stream.request_ids]
        _raise_if_failed(outs)
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                index = i * p.params.n + c.index
                if p.kind == "chat":
                    choice = {"index": index, "message": {"role": "assistant", "content": c.text, **MESSAGE_NULLS},
                              "logprobs": _chat_logprobs(c.logprobs, c.token_ids, p.params.logprobs, self.token_bytes)
                              if c.logprobs is not None else None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                else:
                    choice = {"index": index, "text": c.text,
                              "logprobs": _completion_logprobs(c.logprobs, c.token_ids, p.params.logprobs, 0)
                              if c.logprobs is not None else None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "prompt_logprobs": None}
                if p.return_token_ids:  # vLLM's places: the prompt's ids per completion choice, once for a chat
                    if p.kind == "completion":
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                choices.append(choice)
        body = {"id": p.request_id, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                "created": p.created, "model": self.model_name, "choices": choices, **RESPONSE_NULLS,
                "usage": {**_usage(outs), "prompt_tokens_details": None}}
        if p.kind == "chat":  # vLLM's ChatCompletionResponse has it once, a completion choice each its own
            body["prompt_logprobs"] = None
        body["kv_transfer_params"] = None
        if p.return_token_ids and p.kind == "chat":
            body["prompt_token_ids"] = list(outs[0].prompt_token_ids)
        return body

    # ------------------------------------------------------------------ streams

    async def event_stream(self, p: Prepared) -> AsyncIterator[str]:
        """Server-sent events laid out as vLLM's server sends them: one choice per chunk, usage if
        asked, ``[DONE]``.

        A chat stream opens with one chunk per choice carrying ``delta: {"role": "assistant",
        "content": ""}`` (and ``prompt_token_ids`` with ``return_token_ids``); content deltas
        follow without the role. Every later chunk holds the news of a single choice (its
        ``index``: prompt number * n + sample number), the last one its ``finish_reason``. With
        ``continuous_usage_stats`` each chunk's ``usage`` counts that choice's prompt and the
        tokens it has generated so far (vLLM's serving_chat.py / serving_completion.py); with
        ``include_usage`` (on whenever ``stream_options`` is sent, unless sent false or null) a last
        chunk with no choices sums every prompt and choice, also after continuous usage.

        The request is submitted when the response starts (a client gone before then costs
        nothing); the ``finally`` aborts unfinished engine requests: a client that
        disconnects ends this generator (the server cancels it), and its KV blocks are released (a block another request
        shares stays in use).
        """
        stream = self.open_stream(p)
        sent: dict[int, _Choice] = {}
        latest: dict[str, RequestOutput] = {}
        order = {rid: i for i, rid in enumerate(stream.request_ids)}
        obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
        num_choices = len(stream.request_ids) * p.params.n
        roles_sent = p.kind != "chat"

        def chunk(choice: dict[str, Any], usage: dict[str, int] | None) -> str:
            body = {"id": p.request_id, "object": obj, "created": p.created, "model": self.model_name,
                    "choices": [choice]}
            if usage is not None:
                body["usage"] = usage
            return sse(body)

        def prompt_of(i: int) -> list[int]:
            """Choice ``i``'s prompt token ids (from its output once there is one)."""
            out = latest.get(stream.request_ids[i // p.params.n])
            return list(out.prompt_token_ids) if out is not None else list(p.prompt_ids[i // p.params.n])

        def usage_of(i: int) -> dict[str, int]:
            """Choice ``i``'s usage so far: its prompt's tokens and the tokens it generated."""
            out = latest.get(stream.request_ids[i // p.params.n])
            c = next((c for c in out.outputs if c.index == i % p.params.n), None) if out is not None else None
            prompt, completion = len(prompt_of(i)), len(c.token_ids) if c is not None else 0
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        def roles() -> list[str]:
            """The chat stream's opening chunks, one per choice (vLLM sends them before any content)."""
            opening = []
            for i in range(num_choices):
                body = {"id": p.request_id, "object": obj, "created": p.created, "model": self.model_name,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]}
                if p.return_token_ids:  # on each opening chunk, as vLLM's loop over the choices puts it
                    body["prompt_token_ids"] = prompt_of(i)
                if p.continuous_usage:  # sent before any content: no completion tokens yet, as vLLM counts it
                    prompt = len(prompt_of(i))
                    body["usage"] = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
                opening.append(sse(body))
            return opening

        try:
            async for outputs in stream:
                for out in outputs:
                    latest[out.request_id] = out
                    if out.finished and out.error is not None:
                        yield sse(_error_of(out).body())
                        continue
                    if not roles_sent:
                        for event in roles():
                            yield event
                        roles_sent = True
                    for c in out.outputs:
                        index = order[out.request_id] * p.params.n + c.index
                        choice = self._delta(p, sent.setdefault(index, _Choice()), index, c, out.prompt_token_ids)
                        if choice is not None:
                            yield chunk(choice, usage_of(index) if p.continuous_usage else None)
            if stream.ended_early:  # the server is stopping: every choice still open ends as aborted
                if not roles_sent and any(not sent.get(i, _Choice()).done for i in range(num_choices)):
                    for event in roles():
                        yield event
                for i in range(num_choices):
                    if not sent.get(i, _Choice()).done:
                        yield chunk(self._aborted(p, i), usage_of(i) if p.continuous_usage else None)
            if p.include_usage:  # every prompt (also one the shutdown ended before its first output) and choice
                prompt = sum(len(prompt_of(j * p.params.n)) for j in range(len(stream.request_ids)))
                completion = sum(len(c.token_ids) for out in latest.values() for c in out.outputs)
                yield sse({"id": p.request_id, "object": obj, "created": p.created, "model": self.model_name,
                           "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                    "total_tokens": prompt + completion}})
            yield sse("[DONE]")
        finally:
            stream.close()

    @staticmethod
    def _aborted(p: Prepared, index: int) -> dict[str, Any]:
        """The last chunk choice of a choice the server's shutdown ended: shaped as the engine's own
        abort (a control API ``abort``, a client gone) ends one in :meth:`_delta`, with no new text
        (``"delta": {"content": ""}``, vLLM's ``DeltaMessage(content=delta_text)``; it was
        ``"delta": {}`` here, trial 14b)."""
        choice = {"index": index, **({"delta": {"content": ""}} if p.kind == "chat" else {"text": ""}),
                  "logprobs": None, "finish_reason": "abort", "stop_reason": None}
        if p.return_token_ids:
            choice["token_ids"] = []
        return choice

    def _delta(self, p: Prepared, s: _Choice, index: int, c: CompletionOutput,
               prompt_token_ids: list[int]) -> dict[str, Any] | None:
        """The chunk choice for what ``c`` adds to what was sent (None when nothing new: no token, no text,
        no finish); a completion choice's first chunk carries ``prompt_token_ids`` with ``return_token_ids``
        (vLLM). A new token that adds no text yet (a byte token inside a character, text held back while a stop
        string may match) still gets its chunk, ``""``, as vLLM sends one per output with new tokens (trial
        38b: a 6-token emoji came as 3 chunks, ``continuous_usage_stats`` jumping 1, 4, 6)."""
        if s.done:
            return None
        text, new_tokens = c.text[s.chars:], c.token_ids[s.tokens:]
        finished = c.finish_reason is not None
        if not (text or finished or new_tokens):
            return None
        lp = c.logprobs[s.tokens:len(c.token_ids)] if c.logprobs is not None else None
        if p.kind == "chat":
            choice = {"index": index, "delta": {"content": text},  # the role went in the stream's opening chunk
                      "logprobs": _chat_logprobs(lp, new_tokens, p.params.logprobs, self.token_bytes)
                      if lp is not None else None}
        else:
            logprobs = _completion_logprobs(lp, new_tokens, p.params.logprobs, s.offset) if lp is not None else None
            if logprobs is not None:
                s.offset += sum(len(t) for t in logprobs["tokens"])
            choice = {"index": index, "text": text, "logprobs": logprobs}
        choice["finish_reason"] = c.finish_reason if finished else None
        if finished or p.kind == "completion":  # vLLM: a chat chunk names stop_reason only when its choice ends,
            choice["stop_reason"] = c.stop_reason if finished else None  # a completion chunk always (trial 26a)
        if p.return_token_ids:
            if p.kind == "completion" and not s.started:
                choice["prompt_token_ids"] = list(prompt_token_ids)
            choice["token_ids"] = list(new_tokens)
        s.chars, s.tokens, s.started, s.done = len(c.text), len(c.token_ids), True, finished
        return choice


# Keys vLLM's whole (not streamed) responses always carry (its protocol.py models dumped with
# model_dump(), None included) for what this server never makes: no service tiers, no system
# fingerprint, no prompt logprobs (prompt_logprobs is not a request field here), no cached-token
# counts (usage.prompt_tokens_details), no disaggregated KV transfer. A client that checks the key
# set finds vLLM's. Streamed chunks leave them out, as vLLM's (exclude_unset) do. The chat message
# keeps role and content only: a client that sends the message back in its next request would meet
# this server's refusal of unknown message fields (vLLM's refusal, audio, ... nulls).
RESPONSE_NULLS: dict[str, Any] = {"service_tier": None, "system_fingerprint": None}

SERVER_ID_PREFIXES = ("cmpl-", "chatcmpl-", "ctl-")  # ids the server makes; a client may not choose them


def _usage_options(req: Any) -> tuple[bool, bool]:
    """(usage chunk at the end, usage on every chunk) from ``stream_options``, as vLLM's
    ``should_include_usage`` reads them: ``include_usage`` is true when left out, off when sent
    false or null (``StreamOptions``), and usage on every chunk needs it on (``{"include_usage": false,
    "continuous_usage_stats": true}`` sends no usage at all); no ``stream_options``, no usage."""
    o = req.stream_options
    include = bool(o and o.include_usage)
    return include, include and bool(o.continuous_usage_stats)


def _error_of(out: RequestOutput) -> APIError:
    if out.outputs and out.outputs[0].finish_reason == "rejected":
        return APIError(out.error or "the engine refused this request", code="rejected")
    return APIError(out.error or "the engine failed on this request", status=500, type="server_error",
                    code="engine_error")


def _raise_if_failed(outs: list[RequestOutput]) -> None:
    for out in outs:
        if out.error is not None:
            raise _error_of(out)


def _usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _shown(entry: dict[int, Logprob], token_id: int, top: int) -> list[tuple[int, Logprob]]:
    """The candidates of one token as (token id, Logprob), in the order of vLLM's logprobs dict: the
    sampled token first, then the ``top`` most likely others by rank (so ``top`` + 1 entries at most,
    one when ``top`` is 0). Completions show them all; chat the first ``top`` (vLLM's
    ``_get_top_logprobs``: ``i < top_logprobs``)."""
    others = sorted(((t, lp) for t, lp in entry.items() if t != token_id and lp.rank <= top), key=lambda p: p[1].rank)
    return [(token_id, entry[token_id])] + others


def _completion_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top: int, first_char: int) -> dict:
    """OpenAI's legacy completions logprobs: tokens, their log-probabilities, top candidates, text offsets.

    ``entries[i]`` (``CompletionOutput.logprobs``) holds the top candidates and always the
    sampled ``token_ids[i]``; ``first_char``: the text offset of the first of these tokens (the
    characters of the tokens before it, so streamed and whole answers agree). Each
    ``top_logprobs`` dict holds the sampled token and the ``top`` most likely (vLLM's rule).
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = first_char
    for entry, token_id in zip(entries, token_ids):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for _, lp in _shown(entry, token_id, top)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top: int,
                   token_bytes: Callable[[int, str], bytes]) -> dict:
    """OpenAI's chat logprobs: per token its text, log-probability, own UTF-8 bytes and top candidates.

    ``bytes`` are the token's own bytes (``token_bytes``), so the chosen tokens' bytes joined are
    the content's UTF-8 even where one character spans several tokens (each token's text is
    then U+FFFD, its bytes are not). ``top_logprobs``: ``top`` entries as vLLM's chat gives them, the
    sampled token first, then the most likely others by rank (:func:`_shown`): a sampled token outside
    the ``top`` most likely is listed, in place of the ``top``-th (trial 34b: it was left out, where
    vLLM's chat and this server's completions list it).
    """
    def item(token_id: int, lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(token_bytes(token_id, text))}

    content = []
    for entry, token_id in zip(entries, token_ids):
        chosen = item(token_id, entry[token_id])
        chosen["top_logprobs"] = [item(t, lp) for t, lp in _shown(entry, token_id, top)[:top]]
        content.append(chosen)
    return {"content": content}

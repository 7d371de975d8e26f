"""OpenAI's request bodies, as vLLM's server accepts them, and OpenAI's error body.

Field names and defaults follow the OpenAI API (``max_tokens`` 16 for completions,
``temperature`` 1) plus vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``priority``, ``stop_token_ids``,
``return_token_ids``, ...). A field this server does not know is refused, as OpenAI does, so
a misspelt setting never passes silently. Every error becomes :class:`APIError`, which the
server answers with OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, StrictBool, StrictFloat, StrictInt,
                      ValidationError, WrapValidator, model_validator)
from pydantic_core import PydanticCustomError

from nanovllm_core.prompts import (ChatRole, chat_template_problem, content_problem, content_text, surrogate_text,
                                   template_role, tool_arguments, unicode_problem)
from nanovllm_core.sampling_params import LOGIT_BIAS_LIMIT, VLLM_SAMPLING_UNSUPPORTED, SamplingParams, check_priority
from nanovllm_core.untrusted import clipped, escaped, shown


class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` and ``{"error": {...}}``.

    ``type``: OpenAI's error type (``invalid_request_error``, ``authentication_error``,
    ``server_error``); ``param``: the request field at fault; ``code``: a short machine word.
    """

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        param = None if self.param is None else clipped(self.param)  # a client's own key may be any length (trial 14b)
        # a lone surrogate a message repeats from the client is written as its escape text (trial 29b)
        return {"error": {"message": escaped(self.message), "type": self.type, "param": param, "code": self.code}}

    def renamed(self, names: dict[str, str] | None) -> "APIError":
        """This error with its fields named as the client sent them: ``names`` maps an engine field
        (``SamplingParams.logprobs``) to the request's (``top_logprobs``); ``param`` and every such
        field the message names (``min_tokens ... <= max_tokens``) become the client's."""
        if not names:
            return self
        message = self.message
        for field, sent in names.items():
            if sent != field:
                message = re.sub(rf"(?<![\w.]){re.escape(field)}\b", sent, message)
        return APIError(message, self.status, self.type, names.get(self.param, self.param), self.code)


# What each field typed as a union of shapes takes, in words: pydantic reports such a value once
# per shape tried ("stop.str", "stop.list[str].0"), none of which is the field a client sent.
# tests/test_serve_conformance.py checks that every union-typed field of these bodies is here.
UNION_SHAPES = {
    "stop": "a string or a list of strings",
    "prompt": "text, a list of texts, a list of token ids, or a list of lists of token ids",
}


def validation_error(e: ValidationError, body: Any = None) -> APIError:
    """The first pydantic complaint as one 400 line naming the field (OpenAI's wording for unknown fields).

    A value that fits none of a union field's shapes (:data:`UNION_SHAPES`) is reported once, for
    the field as sent (``stop``, ``messages.0.content``), saying what it takes; ``body`` (the
    request as parsed) gives the value shown. Values and a client's own field names are quoted
    cut short (``untrusted.shown``, ``untrusted.clipped``).
    """
    err = e.errors()[0]
    loc = [p for p in err["loc"] if p != "body"]
    if err["type"] == "string_unicode":  # a lone surrogate (JSON's \udc00) in a key or a text: say so, naming it
        # pydantic cannot name a key that is not valid Unicode: it reports the object holding it (or nothing)
        found = surrogate_text(_at(body, loc), tuple(loc), keys_only=True)
        path = found[0] if found is not None else None
        if path is not None:
            field = ".".join(str(p) for p in path)
            where = f" in {clipped('.'.join(str(p) for p in path[:-1]))}" if len(path) > 1 else ""
            return APIError(f"the request has the key {shown(path[-1])}{where}, which is not valid Unicode: "
                            f"{unicode_problem(path[-1])}", param=field, code="invalid_value")
        if isinstance(err.get("input"), str) and unicode_problem(err["input"]) is not None:
            field = ".".join(str(p) for p in loc) or None
            return APIError(f"{clipped(field or 'a text')} is not valid Unicode: {unicode_problem(err['input'])}",
                            param=field, code="invalid_value")
    for i, part in enumerate(loc):
        if part in UNION_SHAPES and i + 1 < len(loc) and isinstance(loc[i + 1], str):  # the next is a shape's tag
            field = ".".join(str(p) for p in loc[:i + 1])
            value = _at(body, loc[:i + 1])
            got = f" (got {shown(value)})" if value is not _MISSING else ""
            return APIError(f"Invalid value for {clipped(field)}: {part} must be {UNION_SHAPES[part]}{got}",
                            param=field, code="invalid_value")
    field = ".".join(str(p) for p in loc) or None
    if err["type"] == "extra_forbidden":
        if field in NO_OP_TYPES and not isinstance(err.get("input"), NO_OP_TYPES[field]):
            # the type every other field of that type gets ("store": "false" is not told to "send false")
            return APIError(f"Invalid value for {field}: Input should be {NO_OP_TYPES_SHOWN[field]} "
                            f"(got {shown(err.get('input'))})", param=field, code="invalid_value")
        if field in UNSUPPORTED_WHY:  # OpenAI's or vLLM's own field, not a typo: say what this server takes
            return APIError(unsupported_message(field), param=field, code="invalid_value")
        if len(loc) == 3 and loc[0] == "messages" and loc[2] in MESSAGE_UNSUPPORTED:  # a response's message sent back
            return APIError(f"{field} is not supported by this server ({MESSAGE_UNSUPPORTED[loc[2]]}); leave it out "
                            "or send null", param=field, code="invalid_value")
        return APIError(f"Unrecognized request argument supplied: {clipped(field)}", param=field,
                        code="unknown_parameter")
    if err["type"] == "missing":
        return APIError(f"Missing required parameter: {field}", param=field, code="missing_required_parameter")
    # pydantic names its own class ("a valid dictionary or instance of StreamOptions"): a client sent JSON
    message = "Input should be a JSON object" if err["type"] in ("model_type", "dataclass_type") else err["msg"]
    # the value as sent, cut short: a 900 KB temperature came back as a 900 KB error (trial 14b)
    got = "" if err["type"] == "field_value" and "got " in message else f" (got {shown(err.get('input'))})"
    return APIError(f"Invalid value for {clipped(field)}: {message}{got}", param=field,  # one "got" (trial 41b)
                    code="invalid_value")


_MISSING = object()


def _at(body: Any, path: list) -> Any:
    """``body[path[0]][path[1]]...`` (``_MISSING`` where the path does not lead anywhere)."""
    for key in path:
        try:
            body = body[key]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return body


def whole_number(value: Any) -> Any:
    """A JSON number with no fractional part as an ``int`` (``3.0`` -> ``3``); any other value unchanged.

    The one rule for every integer field of this server's HTTP API (completions, chat and the
    engine control API): vLLM and OpenAI take ``3.0`` for an integer field, so it counts as
    ``3``; ``3.5``, ``inf``, ``"3"`` and ``true`` are left as they are, and so refused as not
    integers. A huge whole number (``1e30``) becomes a huge ``int``, which the field's range
    check refuses as it refuses the same number written ``1000...``.
    """
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field: an int, or a float with no fractional part (see whole_number); never a string or bool.
Int = Annotated[StrictInt, BeforeValidator(whole_number)]


def _int_as_sent(value: Any, handler: Any) -> Any:
    """A number field's value: an integer the client sent stays an int (so an error quotes ``-1`` as it
    was sent, not pydantic's ``-1.0``; trial 17a), while one past a float's exact range and any other
    input go through ``StrictFloat`` (a float, or pydantic's own refusal)."""
    if type(value) is int and -2 ** 53 <= value <= 2 ** 53:
        return value
    return handler(value)


# A JSON number field (temperature, a bias): StrictFloat, except that an integer stays an int until
# SamplingParams has checked it (``_SamplingBody.sampling_params`` makes it a float after)
Number = Annotated[StrictFloat, WrapValidator(_int_as_sent)]
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class _Body(BaseModel):
    """A request body (or part of one): unknown fields refused; ``null`` in an optional field means its default.

    OpenAI's spec marks its optional fields nullable and vLLM's server takes ``null`` for any of
    them as "not sent", so ``"n": null`` is ``n=1`` and ``"stream": null`` is ``stream=false``;
    ``NULL_KEPT`` names the exceptions whose null means something else (completions' ``max_tokens``).
    A required field (``prompt``, ``messages``, a message's ``role``) keeps refusing ``null``
    with its one-line 400. ``NULL_ONLY``: fields this server does not support but takes as
    ``null`` or as their value that asks for nothing (``NO_OP_VALUES``: ``response_format``
    ``{"type": "text"}``, ``tools`` ``[]``, ``tool_choice`` ``"none"``, ``store`` ``false``; =
    not sent); any other value of them is a 400 saying the field is not supported here.
    """

    model_config = ConfigDict(extra="forbid")
    NULL_ONLY: ClassVar[frozenset[str]] = frozenset()
    # Optional fields whose ``null`` is a value of its own, not "not sent" (completions'
    # ``max_tokens``: absent is 16, null is "up to the model's length", as vLLM reads it).
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        optional = ({name for name, f in cls.model_fields.items() if not f.is_required()} | cls.NULL_ONLY) - cls.NULL_KEPT
        return {k: v for k, v in data.items() if not (v is None and k in optional)
                and not (k in cls.NULL_ONLY and asks_nothing(k, v))}


def asks_nothing(field: str, value: Any) -> bool:
    """Whether ``value`` of an unsupported field is one of its :data:`NO_OP_VALUES`, of the same JSON
    type (``"store": 0`` is not ``false``, though ``0 == False`` in Python)."""
    return any(type(value) is type(v) and value == v for v in NO_OP_VALUES.get(field, ()))


# OpenAI fields this server does not support, each with the values that ask for nothing (taken as
# not sent, as vLLM takes them; trial 11: a client that always sends response_format {"type":
# "text"} could not use the server) and why any other value is refused.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "store": (False,)}
# the JSON types OpenAI gives those fields (tool_choice: "none"/"auto"/... or an object naming a tool);
# a value of another type is a type error, as for any other field
NO_OP_TYPES: dict[str, tuple[type, ...]] = {
    "response_format": (dict,), "tools": (list,), "tool_choice": (str, dict), "store": (bool,)}
NO_OP_TYPES_SHOWN = {"response_format": "a valid dictionary", "tools": "a valid list",
                     "tool_choice": "a valid string or dictionary", "store": "a valid boolean"}
UNSUPPORTED_WHY = {
    "response_format": "no structured output: the text is whatever the model writes",
    "tools": "no tool calling; tool messages in messages are rendered through the chat template",
    "tool_choice": "no tool calling",
    "store": "it keeps no completions to list or distill later",
}
# Fields OpenAI or vLLM define that this server does not implement (trial 21b: they were refused as
# "Unrecognized request argument", even as null, while the server's own responses carry three of
# them as null). Each: why, and what to do instead (default "leave it out"). Null, or a value in
# VLLM_NO_OP_VALUES (vLLM's own default, which asks for nothing), is taken as not sent; any other
# value is a 400 in these words. docs/serving.md lists them.
VLLM_UNSUPPORTED: dict[str, tuple[str, str]] = {
    "reasoning_effort": ("no reasoning models or reasoning parser: the text is the answer", ""),
    "include_reasoning": ("no reasoning models or reasoning parser: the text is the answer", ""),
    "service_tier": ("one tier: every request runs in this engine's one queue", ""),
    "functions": ("no tool calling (functions is OpenAI's old tools)", ""),
    "function_call": ("no tool calling (function_call is OpenAI's old tool_choice)", ""),
    **{name: ("no structured output: the text is whatever the model writes", "")
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag")},
    "use_beam_search": ("no beam search", ""),
    "length_penalty": ("no beam search", ""),
    # vLLM's SamplingParams fields that its server also takes: one reason in Python and over HTTP
    **{name: VLLM_SAMPLING_UNSUPPORTED[name] for name in ("prompt_logprobs", "allowed_token_ids", "bad_words",
                                                          "logits_processors", "truncate_prompt_tokens")},
    "add_special_tokens": ("prompts are tokenized the one way the engine does", ""),
    "spaces_between_special_tokens": VLLM_SAMPLING_UNSUPPORTED["spaces_between_special_tokens"],
    "return_tokens_as_token_ids": ("logprob tokens are always text",
                                   "leave it out (return_token_ids gives the token ids)"),
    "chat_template": ("the model's own chat template only",
                      "leave it out (chat_template_kwargs passes variables to the model's template)"),
    "documents": ("the chat template is given no documents", "leave it out and put the documents' text in a message"),
    "mm_processor_kwargs": ("text only", ""),
    "prompt_embeds": ("text only: prompts are text or token ids", ""),
    "cache_salt": ("one prefix cache, shared by every request of this server", ""),
    "kv_transfer_params": ("one process, no KV transfer", ""),
    "vllm_xargs": ("no extensions", ""),
}
VLLM_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "service_tier": ("auto", "default"), "use_beam_search": (False,), "length_penalty": (1.0, 1),
    "include_reasoning": (True,), "spaces_between_special_tokens": (True,), "return_tokens_as_token_ids": (False,),
    "bad_words": ([],)}
NO_OP_VALUES.update(VLLM_NO_OP_VALUES)
UNSUPPORTED_WHY.update({name: why for name, (why, _) in VLLM_UNSUPPORTED.items()})


# An assistant message's fields that OpenAI and vLLM put in a response message, null where the model
# made none of them; a client sending a response's message back in ``messages`` sends them too.
# Null is taken as not sent (and this server's response messages carry them null, as vLLM's do);
# any other value is a 400 saying why (trial 25a).
MESSAGE_UNSUPPORTED: dict[str, str] = {
    "refusal": "a refusal is not told apart from the text: the text is the answer",
    "audio": "text only",
    "annotations": "no web search or citations",
    "function_call": "no tool calling (function_call is OpenAI's old tool_calls)",
    "reasoning": "no reasoning models or reasoning parser: the text is the answer",
    "reasoning_content": "no reasoning models or reasoning parser: the text is the answer",
}
# The null fields of a response's chat message, as vLLM sends them (tool_calls left out when empty)
MESSAGE_NULLS: dict[str, None] = dict.fromkeys(("refusal", "annotations", "audio", "function_call", "reasoning"))


def unsupported_message(field: str) -> str:
    """The one line refusing a value of ``field``, a field of OpenAI's or vLLM's this server does
    not implement: what is not supported, why, and what to do (leave it out, or the alternative;
    or send a value that asks for nothing, :data:`NO_OP_VALUES`)."""
    todo = VLLM_UNSUPPORTED.get(field, ("", ""))[1] or "leave it out"
    if field in NO_OP_VALUES:
        todo += " or send " + " or ".join(json.dumps(v) for v in NO_OP_VALUES[field])
    return f"{field} is not supported by this server ({UNSUPPORTED_WHY[field]}); {todo}"
ECHO_REFUSED = ("echo=true is not supported by this server (a response holds the generated text only, not the "
                "prompt); leave it out or send false")


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


def _field_error(message: str) -> PydanticCustomError:
    """A field's own refusal, its ``message`` whole in the 400 (a ``ValueError`` came out as "Value error, ...":
    pydantic's prefix, trial 36b)."""
    return PydanticCustomError("field_value", "{message}", {"message": message})


def _openai_metadata(value: dict[str, str]) -> dict[str, str]:
    """Chat's ``metadata``, as OpenAI bounds it: at most 16 pairs, keys of at most 64 characters,
    values of at most 512."""
    if len(value) > METADATA_PAIRS:
        raise _field_error(f"metadata holds at most {METADATA_PAIRS} key-value pairs, got {len(value)}")
    bad = surrogate_text(value)
    if bad is not None:  # it is never read, but a text with no UTF-8 form is refused wherever it is sent (trial 29b)
        raise _field_error(f"metadata's {bad[1]} {shown(bad[0][-1])} is not valid Unicode: {bad[2]}")
    for key, text in value.items():
        if len(key) > METADATA_KEY_CHARS or len(text) > METADATA_VALUE_CHARS:
            raise _field_error(f"metadata keys hold at most {METADATA_KEY_CHARS} characters and values at most "
                             f"{METADATA_VALUE_CHARS}; {shown(key)} does not fit")
    return value


def _user_text(value: str) -> str:
    """``user`` (OpenAI's end-user id): never read, but a text with no UTF-8 form is refused wherever it
    is sent (trial 33b: only this one was taken)."""
    problem = unicode_problem(value)
    if problem is not None:
        raise _field_error(f"user is not valid Unicode: {problem}")
    return value


class StreamOptions(_Body):
    """How a stream reports usage, read as vLLM's ``StreamOptions`` reads it.

    ``include_usage`` (true when left out, vLLM's default: sending ``stream_options`` at all
    asks for usage; ``false`` or ``null`` turn it off, as vLLM's ``bool | None`` field and its
    ``bool(stream_options.include_usage)`` read them, trial 30b): one more chunk before ``[DONE]``
    with no choices and the request's token counts. ``continuous_usage_stats`` (false unless sent
    true; ``null`` is false too): also usage on every chunk, only when ``include_usage`` is on
    (vLLM's ``include_usage and continuous_usage_stats``). No ``stream_options``: no usage in the stream.
    """

    # null is a value here (off), not "not sent" (which for include_usage would be on), as in vLLM
    NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"include_usage", "continuous_usage_stats"})
    include_usage: StrictBool | None = True
    continuous_usage_stats: StrictBool | None = False


def logit_bias_ids(bias: Any, param: str = "logit_bias") -> dict[Any, Any]:
    """``bias`` with its JSON keys (token ids written as text, OpenAI's shape) as ints, as vLLM's
    ``SamplingParams.from_optional`` converts them (``int(token)``); ``SamplingParams`` then clamps each
    bias to [-100, 100], and the engine checks the ids against the vocabulary. A bias too large for a
    float (``1e400``, which JSON's parser reads as infinity) is clamped too, as vLLM's
    ``min(100, max(-100, bias))`` clamps it. ``param``: the field as the client named it
    (``params.logit_bias`` on the control API). Errors quote a key as the client sent it (text).

    Raises:
        APIError: not an object, or a key that is not a token id (text ``int()`` reads as an integer >= 0).
    """
    if not isinstance(bias, dict):
        raise APIError(f"{param}={shown(bias)} is invalid: must be an object of token id to bias "
                       '(e.g. {"50256": -100}) or null', param=param, code="invalid_value")
    out = {}
    for key, value in bias.items():
        token = _token_key(key)
        if token is None or token < 0:
            raise APIError(f"{param} has the key {shown(key)}, which is not a token id; keys are token ids "
                           '(integers >= 0) written as text, e.g. {"1234": -100}', param=param, code="invalid_value")
        if isinstance(value, float) and abs(value) == float("inf"):
            value = LOGIT_BIAS_LIMIT if value > 0 else -LOGIT_BIAS_LIMIT
        out[token] = value
    return out


def _token_key(key: Any) -> int | None:
    """A logit_bias key as vLLM reads it, Python's ``int(key)``: ``"30"``, ``"030"``, ``" 30"``, ``"+30"``
    and ``"3_0"`` are all token 30 (trial 17a: only the first two were taken); None for text ``int()``
    refuses (``"abc"``, ``"3.0"``, more than 4300 digits) or a key that is not text."""
    if not isinstance(key, str):
        return None
    try:
        return int(key)
    except ValueError:
        return None


class _SamplingBody(_Body):
    """The fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: Int = 1
    best_of: Int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Annotated[str, AfterValidator(_user_text)] | None = None
    logit_bias: dict[str, Number] | None = None
    # vLLM's extra sampling parameters
    top_k: Int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Int = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: Int = 0
    return_token_ids: StrictBool = False
    echo: StrictBool = False  # vLLM's, on both routes: refused when true (ECHO_REFUSED)
    # vLLM's: the response's id, as the X-Request-Id header gives it (the header wins when both are
    # sent, as in vLLM's _base_request_id); the same rules as the header (api_server.client_request_id)
    request_id: str | None = None
    # OpenAI's, taken and ignored as vLLM does, on both routes (vLLM's request models take any extra
    # field; trial 15b: completions refused them while docs/serving.md said they are taken): with no
    # tools (tools may only be [] here) no call is made, in parallel or not; metadata tags a stored
    # completion, and none is stored (store: false)
    parallel_tool_calls: StrictBool | None = None
    metadata: Annotated[dict[str, str], AfterValidator(_openai_metadata)] | None = None
    # tool calling, structured output and stored completions are not supported here: null (= not
    # sent), or the value that asks for nothing (NO_OP_VALUES), only; the same on both routes
    NULL_ONLY = frozenset({"tools", "tool_choice", "response_format", "store", *VLLM_UNSUPPORTED})

    def _check_common(self) -> None:
        if self.echo:  # one message for both routes (chat said "Unrecognized request argument", trial 14b)
            raise APIError(ECHO_REFUSED, param="echo", code="invalid_value")
        if self.best_of is not None and self.best_of != self.n:  # (every "not supported" value: invalid_value)
            raise APIError("best_of other than n is not supported; leave it out", param="best_of", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true; send \"stream\": true or leave stream_options "
                           "out", param="stream_options", code="invalid_value")
        try:  # the bound every entry point shares (vLLM takes any integer; a huge one is refused here)
            check_priority(self.priority)
        except ValueError as e:
            raise APIError(str(e), param="priority", code="invalid_value") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's ``SamplingParams``; OpenAI's defaults where a field is absent.

        Raises:
            APIError: a value the engine refuses (the message names the field and its range).
        """
        self._check_common()
        values = dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.token_logit_bias(),
        )
        try:
            params = SamplingParams(**values)  # an int as sent, so that an error quotes it so
        except ValueError as e:
            message = str(e).removeprefix("SamplingParams.")
            field = message.split("=", 1)[0].split(" ", 1)[0]
            raise APIError(message, param=field if field in values else None,
                           code="invalid_value").renamed(self.field_names()) from None
        for name in FLOAT_FIELDS:  # what the engine got before: floats, as pydantic made them
            setattr(params, name, float(getattr(params, name)))
        return params

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its JSON keys as ints (:func:`logit_bias_ids`)."""
        return None if self.logit_bias is None else logit_bias_ids(self.logit_bias)

    def field_names(self) -> dict[str, str]:
        """The request field that gave each ``SamplingParams`` field named otherwise here (errors name it)."""
        return {}


class CompletionRequest(_SamplingBody):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one choice set each)."""

    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    suffix: str | None = None
    NULL_KEPT = frozenset({"max_tokens"})  # null: up to the model's length (vLLM), absent: 16 (OpenAI)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a single text or token list becomes a list of one).

        Raises:
            APIError: an empty prompt list, or ``suffix`` (not supported).
        """
        if self.suffix:
            raise APIError("suffix is not supported by this server; leave it out", param="suffix", code="invalid_value")
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError("prompt is empty; send text or a list of token ids", param="prompt", code="invalid_value")
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


def _content(value: Any) -> Any:
    """A message's ``content``, checked by the one rule ``LLM.chat`` follows too (``prompts.content_problem``:
    text, or a list of text parts and strings), whose line names the part and any unknown key in it
    (trial 36c: a part with an extra key got a line that named neither)."""
    problem = content_problem(value)
    if problem is not None:
        raise PydanticCustomError("content_shape", "{problem}", {"problem": problem})
    return value


class FunctionCall(_Body):
    """The function an assistant's tool call names; ``arguments``: JSON text, as the model wrote it."""

    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One message; ``content`` is text or a list of text parts (images are not supported).

    An assistant message may carry the ``tool_calls`` it made, and a ``tool`` message the
    ``tool_call_id`` it answers; both reach the chat template as vLLM gives them (a call's arguments parsed
    from their JSON text: ``prompts.tool_arguments``). The
    server does not parse tool calls out of generated text: a model's answer is its text.
    """

    NULL_ONLY: ClassVar[frozenset[str]] = frozenset(MESSAGE_UNSUPPORTED)  # null: not sent (a response's message)

    role: ChatRole  # the one list of roles, shared with LLM.chat (nanovllm_core.prompts.CHAT_ROLES)
    content: Annotated[Any, AfterValidator(_content)] = None  # text or parts (TEXT_PART_TYPES); None: left out
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template takes it (``developer`` becomes ``system``)."""
        message: dict[str, Any] = {"role": template_role(self.role), "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:  # arguments as the object their JSON holds, as vLLM gives a template
            message["tool_calls"] = [{**call.model_dump(), "function": {
                "name": call.function.name, "arguments": tool_arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        """The content as one text: its text parts joined by ``prompts.content_text``, as ``LLM.chat`` joins them."""
        return content_text(self.content)


class ChatCompletionRequest(_SamplingBody):
    """``POST /v1/chat/completions``: the model's chat template renders ``messages``.

    ``max_tokens`` (or ``max_completion_tokens``) absent: up to the model's length, as vLLM does.
    ``logprobs`` is a yes/no here, with ``top_logprobs`` candidates per token. ``parallel_tool_calls``
    (any boolean) and ``metadata`` (OpenAI's string pairs) are taken and ignored, as vLLM takes them
    (on completions too: ``_SamplingBody``).
    """

    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    add_generation_prompt: StrictBool = True
    # vLLM's chat template options: leave the last message open for the model to continue (needs
    # add_generation_prompt false), and extra variables for the template (prompts.chat_template_problem)
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        """The chat template options, checked: ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs`` (``LLMEngine.chat_token_ids``' arguments).

        Raises:
            APIError: both ``continue_final_message`` and ``add_generation_prompt`` true, or a
                ``chat_template_kwargs`` key that is a renderer setting.
        """
        problem = chat_template_problem(self.add_generation_prompt, self.continue_final_message,
                                        self.chat_template_kwargs)
        if problem is not None:
            raise APIError(problem[1], param=problem[0], code="invalid_value")
        bad = surrogate_text(self.chat_template_kwargs, ("chat_template_kwargs",))
        if bad is not None:  # the template renders these: a text with no UTF-8 form is refused as content is
            where = ".".join(str(p) for p in bad[0])
            raise APIError(f"{clipped(where)} ({'a key' if bad[1] == 'key' else 'a text'}) is not valid Unicode: "
                           f"{bad[2]}", param=where, code="invalid_value")
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs}

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them.

        Raises:
            APIError: as :func:`checked_conversation`.
        """
        return checked_conversation(self.messages)

    def field_names(self) -> dict[str, str]:
        """``logprobs`` counts come from ``top_logprobs``; ``max_tokens`` from ``max_completion_tokens`` when sent."""
        return {"logprobs": "top_logprobs",
                "max_tokens": "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"}

    def _check_top_logprobs(self) -> None:
        """vLLM's ``ChatCompletionRequest.check_logprobs``: ``top_logprobs`` must be ``>= 0`` or -1, and a
        count that asks for candidates (``-1`` or ``> 0``) needs ``logprobs: true``; ``0`` without it is
        accepted (no logprobs, as vLLM runs it), as some SDKs always send ``top_logprobs: 0``.

        ``-1`` is vLLM's "the whole vocabulary": its engine then refuses it too unless started with
        ``--max-logprobs -1`` (its default allows 20); this server returns at most 20, so ``-1`` is
        refused whatever ``logprobs`` says, with the most it may ask for.

        Raises:
            APIError: 400 ``invalid_value``, ``param`` ``top_logprobs``; the message says what to send.
        """
        top = self.top_logprobs
        if top is None:
            return
        if top == -1:
            raise APIError("top_logprobs=-1 (every token of the vocabulary, as vLLM reads it) is more than the 20 "
                           "this server returns per token; send an integer in [0, 20]", param="top_logprobs",
                           code="invalid_value")
        if top < 0:
            raise APIError(f"top_logprobs={top} is negative; send an integer in [0, 20], or leave it out",
                           param="top_logprobs", code="invalid_value")
        if top > 20:  # said first: "send logprobs: true" alone led to a second 400 for the range (trial 37b)
            raise APIError(f"top_logprobs={top} is invalid: must be an integer in [0, 20]", param="top_logprobs",
                           code="invalid_value")
        if top > 0 and not self.logprobs:
            raise APIError(f"top_logprobs={top} needs logprobs: true; send \"logprobs\": true, or leave "
                           "top_logprobs out", param="top_logprobs", code="invalid_value")

    def to_sampling_params(self) -> SamplingParams:
        self._check_top_logprobs()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)


def checked_conversation(messages: list[ChatMessage], field: str = "messages") -> list[dict[str, Any]]:
    """``messages`` (validated ``ChatMessage`` objects) as the chat template takes them, once each is one
    the chat route serves: ``field`` names the list in errors (``prompt`` for a control ``submit``).

    Raises:
        APIError: no messages; a message without content (only an assistant message with
            ``tool_calls`` may leave it out, as OpenAI and vLLM allow); a lone surrogate in any text
            that reaches the template (content, ``name``, ``tool_call_id``, a tool call's id, function
            name or arguments; trial 29b: only content was checked).
    """
    if not messages:
        raise APIError(f"{field} is empty; send at least one message", param=field, code="invalid_value")
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(f"message {i} ({m.role}) has no content; every message needs content, except an "
                           "assistant message that carries tool_calls", param=f"{field}.{i}.content",
                           code="missing_required_parameter")
        texts = [("content", m.text()), ("name", m.name), ("tool_call_id", m.tool_call_id)]
        for j, call in enumerate(m.tool_calls or ()):
            texts += [(f"tool_calls.{j}.id", call.id), (f"tool_calls.{j}.function.name", call.function.name),
                      (f"tool_calls.{j}.function.arguments", call.function.arguments)]
        for name, text in texts:
            problem = None if text is None else unicode_problem(text)
            if problem is not None:
                raise APIError(f"message {i}'s {name} is not valid Unicode: {problem}", param=f"{field}.{i}.{name}",
                               code="invalid_value")
        for j, call in enumerate(m.tool_calls or ()):
            try:  # the template is given the object (vLLM's rule): text that is not JSON is refused, as vLLM does
                tool_arguments(call.function.arguments)
            except ValueError as e:
                raise APIError(f"message {i}'s tool_calls.{j}.function.arguments {e}",
                               param=f"{field}.{i}.tool_calls.{j}.function.arguments", code="invalid_value") from None
    return [m.template_message() for m in messages]


class _Conversation(_Body):
    messages: list[ChatMessage]


def conversation_of(messages: list, field: str) -> list[dict[str, Any]]:
    """Chat messages sent in ``field`` of another body (a control ``submit``'s ``prompt``), checked
    exactly as ``/v1/chat/completions`` checks its ``messages`` (the same ``ChatMessage`` model and
    :func:`checked_conversation`); errors name ``field`` (``prompt.0.content``). Returns them as
    the chat template takes them.

    Raises:
        APIError: 400, the chat route's error for that message with ``messages`` read ``field``.
    """
    try:
        parsed = _Conversation.model_validate({"messages": messages})
    except ValidationError as e:
        error = validation_error(e, {"messages": messages})
        rename = (lambda text: re.sub(r"(?<![\w.])messages(?=[.\[ ]|$)", field, text))
        raise APIError(rename(error.message), error.status, error.type,
                       None if error.param is None else rename(error.param), error.code) from None
    return checked_conversation(parsed.messages, field)


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's rule: prompt plus ``max_tokens`` must fit in the model's context.

    Raises:
        APIError: the prompt alone fills the context, or prompt + ``max_tokens`` exceeds it.
    """
    if num_prompt_tokens >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                       f"{num_prompt_tokens} tokens, which leaves no room for output. Please shorten the prompt.",
                       param="prompt", code="context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                       "for the completion). Please reduce the length of the prompt or max_tokens.",
                       param="max_tokens", code="context_length_exceeded")

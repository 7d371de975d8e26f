"""Bad input is rejected with a clear reason; the rest of the batch finishes; no block leaks."""

from __future__ import annotations

import re

import pytest

from nanovllm_core import LLM, SamplingParams

pytestmark = pytest.mark.real_model

GOOD = "The capital of France is"


def assert_refused_before_queueing(llm: LLM, message: str, call) -> None:
    """``call()`` raises a one-line ValueError matching ``message`` and leaves no request queued."""
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_each_bad_prompt_is_rejected_while_the_batch_completes_when_asked(make_llm):
    """reject_bad_prompts=True (the command line's way): each bad prompt comes back rejected, the rest run."""
    llm = make_llm(num_kv_blocks=4, block_size=16, max_model_len=100)
    too_long = "word " * 200
    params = [SamplingParams(temperature=0, max_tokens=4)] * 4 + [SamplingParams(temperature=0, max_tokens=200)]
    prompts = [GOOD, "", too_long, [999999], "Hello there"]
    outs = llm.generate(prompts, params, use_tqdm=False, reject_bad_prompts=True)
    reasons = [o.error for o in outs]
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].error is None
    assert "empty" in reasons[1]
    assert "max_model_len is 100" in reasons[2]
    assert "outside the vocabulary" in reasons[3]
    assert "KV blocks" in reasons[4] and "pool has only 4" in reasons[4]
    for o in outs[1:]:
        assert o.finished and o.outputs[0].finish_reason == "rejected"
    assert llm.stats()["kv_blocks_used"] == 0


# Newcomer trial 7: LLM.generate([""]) returned a "rejected" output where vLLM raises. Every prompt the engine's
# add_request would reject is refused up front, naming it, before any prompt is queued.
@pytest.mark.parametrize("prompt,params,message", [
    ("", {}, "the prompt is empty"),
    ([], {}, "the prompt is empty"),
    ("word " * 200, {}, "max_model_len is 100"),
    ([999999], {}, r"token id 999999 is outside the vocabulary \(0..49151\)"),
    ([-1], {}, "token id -1 is outside the vocabulary"),
    ("\ud800", {}, "not valid Unicode"),
    (3.5, {}, "prompt must be a string, a list of token ids, or a list of chat messages"),
    ("Hello there", {"max_tokens": 200}, "KV blocks .* pool has only 4"),
    ("Hello there", {"stop_token_ids": [49152]}, "stop_token_ids contains 49152, outside the vocabulary"),
    ("Hello there", {"n": 300}, "max_num_seqs"),
    ([{"role": "bogus", "content": "Hi"}], {}, "messages\\[0\\] has role \"bogus\"; a role is one of system, developer"),
])
def test_a_bad_prompt_raises_before_any_prompt_is_queued(make_llm, prompt, params, message):
    llm = make_llm(num_kv_blocks=4, block_size=16, max_model_len=100)
    sp, ok = SamplingParams(**{"temperature": 0, "max_tokens": 4, **params}), SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=message) as e:  # alone: the reason as the engine words it
        llm.generate(prompt if isinstance(prompt, str) else [prompt], sp, use_tqdm=False)
    assert "\n" not in str(e.value)
    # a list of one names its index too (trial 16e: generate([[999999]]) did not); one text has no index
    assert str(e.value).startswith("prompts[0]: ") == (not isinstance(prompt, str)), str(e.value)
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: .*{message}") as e:  # among good ones: which one
        llm.generate([GOOD, prompt, "Hello"], [ok, sp, ok], use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()  # GOOD was not queued either
    assert llm.stats()["kv_blocks_used"] == 0
    good = llm.generate([GOOD, "Hello"], ok, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in good] == ["length", "length"] and all(o.error is None for o in good)


def test_every_per_prompt_refusal_names_the_index_of_a_list_even_of_one(make_llm):
    """Trial 16e: engine.md promises ``prompts[N]: ...``, but ``generate([[999999]])`` said only "token id
    999999 is outside the vocabulary". A list of prompts (or of conversations) names the index of the bad
    one, also when it holds one; a single prompt (a text, one token-id list, one conversation) has none."""
    llm = make_llm(num_kv_blocks=4, block_size=16, max_model_len=100)
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: token id 999999 is outside the vocabulary"):
        llm.generate([[999999]], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[2\]: token id 999999 is outside the vocabulary"):
        llm.generate([[1, 2], [3], [999999]], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^token id 999999 is outside the vocabulary"):
        llm.generate([999999], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: the prompt is empty"):
        llm.generate([{"prompt": ""}], sp, use_tqdm=False)
    long_chat = [{"role": "user", "content": "word " * 200}]
    with pytest.raises(ValueError, match=r"^conversation 0: the prompt has \d+ tokens but max_model_len is 100"):
        llm.chat([long_chat], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^the prompt has \d+ tokens but max_model_len is 100"):
        llm.chat(long_chat, sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r'^conversation 0: messages\[0\] has role "robot"'):
        llm.chat([[{"role": "robot", "content": "Hi"}]], sp, use_tqdm=False)
    assert not llm.engine.requests and llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("messages,message", [
    ([{"role": "bogus", "content": "Hi"}], r'^messages\[0\] has role "bogus"; a role is one of system, developer, user, assistant, tool$'),
    ([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}], r'messages\[1\] has role "robot"'),
    ([{"content": "Hi"}], r"messages\[0\] has role null"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no content"),
    ([{"role": "user", "content": 5}], r"messages\[0\] \(user\) content must be text or a list of text parts .*, not int$"),
    # newcomer trial 8: a non-text content part is refused naming it, as the server refuses it
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}],
     r'^messages\[0\] \(user\) content\[0\] is an "image_url" part; only text parts .* are supported$'),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\] text must be a string, not (an )?int"),
    ([{"role": "user", "content": ["Hi", 5]}], r"content\[1\] must be a text part .* or a string, not int"),
    # newcomer trial 8: messages of the wrong type name what was given, not "messages is empty"
    ("hello", r"^messages must be a list of \{'role', 'content'\} dicts \(or a list of such lists\), got a str$"),
    (None, r"^messages must be a list of .*, got None$"),
    ({"role": "user", "content": "Hi"}, r"^messages must be a list of .*, got a dict; put one message in a list"),
    (["Hi", "there"], r"^messages must be a list of .*, got a list of str$"),
    (5, r"^messages must be a list of .*, got an int$"),
    ([[{"role": "user", "content": "Hi"}], "Hi"], r"^conversation 1: a conversation must be a non-empty list .*, got a str$"),
    ([{"role": "user", "content": "Hi"}, "Hi"], r"messages\[1\] must be a dict"),
    ([], "messages is empty"),
    ([[{"role": "user", "content": "Hi"}], [{"role": "bogus", "content": "Hi"}]], r'^conversation 1: messages\[0\] has role "bogus"'),
    ([[{"role": "user", "content": "Hi"}], []], r"^conversation 1: a conversation must be a non-empty list"),
    # trial 9: one that does not fit was named prompts[1]
    ([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "word " * 9000}]],
     r"^conversation 1: the prompt has \d+ tokens"),
])
def test_chat_refuses_the_messages_the_server_refuses_before_queueing(make_llm, messages, message):
    llm = make_llm()
    assert_refused_before_queueing(llm, message, lambda: llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False))


def test_chat_takes_the_text_parts_the_server_takes_and_renders_them_the_same(make_llm):
    """Newcomer trial 8: content as a list of text parts (OpenAI's shape, which the server and vLLM's
    LLM.chat take) reaches the template as the text parts joined by newlines, vLLM's rule (trial 33b: they
    were joined with nothing), through the one helper the server uses."""
    from nanovllm_core.entrypoints.protocol import ChatCompletionRequest

    llm = make_llm()
    sp = SamplingParams(temperature=0, max_tokens=2)
    parts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    as_parts = llm.chat(parts, sp, use_tqdm=False)[0]
    as_text = llm.chat([parts[0], {"role": "user", "content": "Hi\nthere"}], sp, use_tqdm=False)[0]
    assert as_parts.error is None and as_parts.prompt_token_ids == as_text.prompt_token_ids
    server = ChatCompletionRequest.model_validate({"messages": parts}).conversation()
    assert llm.engine.chat_token_ids(server) == as_parts.prompt_token_ids
    # the engine path (generate with a conversation as the prompt) takes them too
    assert llm.generate([parts], sp, use_tqdm=False)[0].prompt_token_ids == as_parts.prompt_token_ids


def test_chat_and_the_server_share_one_definition_of_content():
    """The server checks a message's content with nanovllm_core.prompts' own rule, so the two cannot drift:
    every part type LLM.chat takes, the server takes, and the server's refusal is LLM.chat's line."""
    from nanovllm_core.entrypoints import protocol
    from nanovllm_core.prompts import PART_TEXT_KEY, TEXT_PART_TYPES, content_problem

    for kind in TEXT_PART_TYPES:
        parts = [{"type": kind, PART_TEXT_KEY[kind]: "Hi"}, "there"]
        message = protocol.ChatMessage.model_validate({"role": "assistant", "content": parts})
        assert content_problem(parts) is None and message.text() == "Hi\nthere"
    bad = [{"type": "text", "text": "Hi", "extra": 1}]
    with pytest.raises(Exception) as e:
        protocol.ChatMessage.model_validate({"role": "user", "content": bad})
    assert content_problem(bad) in str(e.value) and '"extra"' in content_problem(bad)


# Newcomer trial 8: LLM.generate(None) raised a bare "'NoneType' object is not iterable", and a dict was
# iterated as its keys. Every wrong type for prompts is one ValueError naming what was given.
@pytest.mark.parametrize("prompts,message", [
    (None, r"^prompts must be a string, a list of token ids, or a list of prompts .*, got None$"),
    (5, r"^prompts must be .*, got an int$"),
    (3.5, r"^prompts must be .*, got a float$"),
    ({"role": "user", "content": "Hi"}, r"^prompts must be .*, got a dict$"),
    ([1, 2, "three"], r"^prompts starts as one token-id list but prompts\[2\] is a str; .*, got a list of int and str$"),
    ([1, [2, 3]], r"^prompts starts as one token-id list but prompts\[1\] is a list of int; .*, got a list of int and list$"),
    (["Hi", 5], r"^prompts\[1\]: prompt must be a string, a list of token ids, or a list of chat messages .*, got an int$"),
    ([[1, 2], ["a", 3]], r"^prompts\[1\]: prompt must be .*, got a list of str and int$"),
])
def test_prompts_of_the_wrong_type_are_one_line_naming_what_was_given(make_llm, prompts, message):
    llm = make_llm()
    assert_refused_before_queueing(llm, message, lambda: llm.generate(prompts, SamplingParams(max_tokens=2),
                                                                      use_tqdm=False))


def test_chat_and_the_server_share_one_list_of_roles(make_llm):
    """Every role the server's ChatMessage takes, LLM.chat takes, and no other (developer reaches the template as system)."""
    from typing import get_args

    from nanovllm_core.entrypoints.protocol import ChatMessage
    from nanovllm_core.prompts import CHAT_ROLES

    assert get_args(ChatMessage.model_fields["role"].annotation) == CHAT_ROLES
    llm = make_llm()
    sp = SamplingParams(temperature=0, max_tokens=2)
    as_developer = llm.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], sp,
                            use_tqdm=False)[0]
    as_system = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], sp,
                         use_tqdm=False)[0]
    assert as_developer.prompt_token_ids == as_system.prompt_token_ids and as_developer.error is None
    engine = llm.engine  # the engine path (the app's prompt bar, the server's control submit) rejects it too
    engine.add_request([{"role": "bogus", "content": "Hi"}], sp)
    (out,) = engine.step()
    assert out.outputs[0].finish_reason == "rejected" and 'has role "bogus"' in out.error


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens"),
    ("temperature", -0.5, "temperature"),
    ("temperature", float("inf"), r"temperature=Infinity is invalid: must be a finite number >= 0"),
    ("top_p", 0.0, "top_p"),
    ("top_k", -5, "top_k"),
    ("n", 0, "n="),
    ("stop", [3], "stop"),
    ("top_p", "0.5", "top_p=\"0.5\" is invalid: must be a number"),
    ("logprobs", 21, r"logprobs=21 is invalid: must be an integer in \[0, 20\]"),
    # flags: "no" would be truthy (newcomer trial, issue 29: the server's control submit passed it on)
    ("ignore_eos", "no", r"ignore_eos=\"no\" is invalid: must be true or false"),
    ("skip_special_tokens", 0, r"skip_special_tokens=0 is invalid: must be true or false"),
    ("include_stop_str_in_output", None, r"include_stop_str_in_output=null is invalid"),
])
def test_invalid_sampling_params_raise_value_error_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


# Newcomer trial 7: SamplingParams(stop=5) raised "TypeError: 'int' object is not iterable". Every field given a
# value of the wrong type raises a one-line ValueError naming it (a field added later is covered too).
_WRONG_TYPE = {"stop": [5, b"stop", {"a": 1}.items(), [None], ["ok", 3]],
               "stop_token_ids": [5, "12", b"12", [1.5], [None], [-1]],
               "seed": ["7", 1.5, True], "max_tokens": ["16", 2.0], "logprobs": ["1", 1.0]}


@pytest.mark.parametrize("field,value", [(f, v) for f in SamplingParams.__dataclass_fields__
                                         for v in [object(), *_WRONG_TYPE.get(f, [])]])
def test_every_sampling_field_of_the_wrong_type_raises_one_line_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}[= ]") as e:
        SamplingParams(**{field: value})
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


HUGE = 10**30  # issue 29 item 3: an absurd integer, and a bool, where an integer is expected


@pytest.mark.parametrize("field,value,message", [
    ("n", HUGE, r"n=1000000000000000000000000000000 is invalid: must be an integer from 1 to 2147483647"),
    ("n", True, r"n=true is invalid: must be an integer from 1 to 2147483647"),
    ("top_k", HUGE, r"top_k=1000000000000000000000000000000 is invalid: .* up to 2147483647"),
    ("top_k", True, r"top_k=true is invalid"),
    ("max_tokens", HUGE, r"max_tokens=1000000000000000000000000000000 is invalid: must be an integer from 1 to 2147483647"),
    ("max_tokens", True, r"max_tokens=true is invalid"),
    ("min_tokens", HUGE, r"min_tokens=1000000000000000000000000000000 is invalid: must be an integer from 0 to 2147483647"),
    ("min_tokens", False, r"min_tokens=false is invalid"),
    ("logprobs", True, r"logprobs=true is invalid: must be an integer in \[0, 20\]"),
    ("logprobs", HUGE, r"logprobs=1000000000000000000000000000000 is invalid"),
    ("stop_token_ids", [True], r"stop_token_ids contains true: token ids are integers >= 0"),
])
def test_absurd_integers_and_bools_in_sampling_params_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message) as e:
        SamplingParams(**{field: value})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("priority", [HUGE, -HUGE, 1001, -1001, True, 1.5, "3"])
def test_a_bad_priority_is_one_line_at_every_library_entry_point_and_queues_nothing(make_llm, priority):
    from nanovllm_core.sampling_params import check_priority

    message = r"priority(\[1\])? must be a whole number from -1000 to 1000, got .*; higher runs first"
    llm = make_llm()
    with pytest.raises(ValueError, match=message) as e:
        llm.generate([GOOD, "Hello"], SamplingParams(max_tokens=2), priority=[0, priority], use_tqdm=False)
    assert "\n" not in str(e.value) and "priority[1]" in str(e.value)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests  # the good first prompt was not queued
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request(GOOD, SamplingParams(max_tokens=2), priority)
    assert not llm.engine.requests
    with pytest.raises(ValueError, match=message):
        check_priority(priority)
    assert check_priority(1000) == 1000 and check_priority(-1000) == -1000


def test_a_bad_priority_is_refused_by_the_controller_in_the_callers_thread(make_engine):
    from nanovllm_core.engine.controller import EngineController

    engine = make_engine()
    controller = EngineController.from_engine(engine, start_paused=True)
    try:
        with pytest.raises(ValueError, match="priority must be a whole number from -1000 to 1000, got 1000000"):
            controller.submit(GOOD, SamplingParams(max_tokens=2), HUGE)
    finally:
        assert controller.shutdown(timeout=5.0)
    assert not engine.requests  # refused in the caller's thread: nothing reached the engine


def test_max_tokens_beyond_the_context_stops_at_max_model_len_as_documented(make_llm):
    """LLM.generate's documented rule (unlike the server's 400): generation ends at max_model_len."""
    llm = make_llm(max_model_len=16)
    out = llm.generate(GOOD, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16


def test_unknown_policy_and_bad_engine_options_raise():
    with pytest.raises(ValueError, match="scheduling_policy='lottery' is unknown"):
        LLM(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="block_size=0"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="unknown LLM option"):
        LLM(max_batch=3)


# Trial 14d: LLM(bogus=1) said only "unknown LLM option(s): bogus".
@pytest.mark.parametrize("kwargs, hint", [
    ({"bogus": 1}, ""),
    ({"blok_size": 4}, " (did you mean block_size?)"),
    ({"speculative_config": {}}, " (did you mean speculative_model= and num_speculative_tokens=?)"),
])
def test_an_unknown_llm_option_names_the_nearest_and_every_valid_one(kwargs, hint):
    with pytest.raises(ValueError) as e:
        LLM(**kwargs)
    name = next(iter(kwargs))
    assert str(e.value).startswith(f"unknown LLM option {name}{hint}; LLM takes attention_backend, block_size, ")
    assert ", progress, " in str(e.value) and str(e.value).endswith("(help(EngineConfig) says what each does)")


# Trial 21c bug 3: a bad progress failed 0.4 s into the load with "'int' object is not callable", naming no option.
@pytest.mark.parametrize("progress, given", [
    (5, "progress=5 is invalid: "),
    ("x", "progress='x' is invalid: "),
    (False, "progress=False is invalid: "),  # was silently replaced by the console bar
    (lambda: None, "progress=<lambda>() is invalid: it is called with three arguments, so "),
    (lambda stage, done: None, "progress=<lambda>(stage, done) is invalid: it is called with three arguments, so "),
])
def test_a_bad_progress_is_one_line_naming_it_before_anything_loads(progress, given, monkeypatch):
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.engine.llm_engine import LLMEngine
    from nanovllm_core.model import loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(loader, "load_model", no_load)
    monkeypatch.setattr(loader, "resolve_model", no_load)
    for make in (lambda: LLM(progress=progress), lambda: LLMEngine.from_config(EngineConfig(), progress=progress)):
        with pytest.raises(ValueError) as e:
            make()
        assert str(e.value).startswith(given) and "\n" not in str(e.value), str(e.value)
        assert str(e.value).endswith("it must be a callable progress(stage, done, total) (stage a str, done and total "
                                     "ints), e.g. lambda stage, done, total: None for no bar, or None for the console bar")


@pytest.mark.parametrize("progress", [None, lambda *a: None, lambda stage, done, total, extra=0: None, print])
def test_a_progress_that_takes_stage_done_total_is_taken(progress):
    from nanovllm_core.model.loader import check_progress

    check_progress(progress)


def test_dtype_of_the_wrong_type_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^dtype=\[\] is unknown; use float32, float16 or bfloat16$"):
        LLM(dtype=[])  # was Python's bare "unhashable type: 'list'"


# Trial 21c bug 7: Python's bare "unexpected keyword argument", with no nearest name and nothing on vLLM's fields.
@pytest.mark.parametrize("kwargs, start", [
    ({"temprature": 0.5}, "unknown SamplingParams option temprature (did you mean temperature?); SamplingParams "
                          "takes frequency_penalty, ignore_eos, "),
    ({"bogus": 1}, "unknown SamplingParams option bogus; SamplingParams takes frequency_penalty, "),
    ({"best_of": 2}, "SamplingParams' best_of (vLLM's) is not supported here (no best-of ranking"),
    ({"bad_words": ["x"]}, "SamplingParams' bad_words (vLLM's) is not supported here (the sampler takes no list "
                           "of banned words); leave it out (logit_bias -100 keeps single tokens out)"),
    ({"allowed_token_ids": [1]}, "SamplingParams' allowed_token_ids (vLLM's) is not supported here"),
    ({"truncate_prompt_tokens": 8}, "SamplingParams' truncate_prompt_tokens (vLLM's) is not supported here"),
    ({"detokenize": False}, "SamplingParams' detokenize (vLLM's) is not supported here"),
    ({"prompt_logprobs": 1}, "SamplingParams' prompt_logprobs (vLLM's) is not supported here"),
    ({"guided_decoding": {}}, "SamplingParams' guided_decoding (vLLM's) is not supported here"),
])
def test_an_unknown_sampling_keyword_names_the_nearest_field_or_says_vllms_is_not_supported(kwargs, start):
    with pytest.raises(TypeError) as e:  # vLLM raises a TypeError here: code written for it catches that
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)  # and this project's bad settings are ValueErrors
    assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)


def test_the_server_refuses_vllms_sampling_fields_for_the_python_apis_reason():
    from nanovllm_core.entrypoints.protocol import VLLM_UNSUPPORTED
    from nanovllm_core.sampling_params import VLLM_SAMPLING_UNSUPPORTED

    shared = set(VLLM_UNSUPPORTED) & set(VLLM_SAMPLING_UNSUPPORTED)
    assert {"prompt_logprobs", "bad_words", "allowed_token_ids", "truncate_prompt_tokens"} <= shared
    assert all(VLLM_UNSUPPORTED[name] == VLLM_SAMPLING_UNSUPPORTED[name] for name in shared)


def test_an_unknown_controller_option_is_refused_before_its_thread_starts():
    from nanovllm_core.engine.controller import EngineController

    with pytest.raises(ValueError, match=r"^unknown EngineController option blocksize \(did you mean block_size\?\)"):
        EngineController(blocksize=4)


@pytest.mark.parametrize("option", ["num_speculative_tokens", "block_size", "max_model_len", "max_num_seqs"])
@pytest.mark.parametrize("value", [HUGE, True])
def test_absurd_engine_counts_are_refused_before_loading(option, value):
    extra = {"speculative_model": "ngram"} if option == "num_speculative_tokens" else {}
    with pytest.raises(ValueError, match=rf"{option}=.* is invalid: it must be a positive integer up to 2147483647"):
        LLM(**{option: value}, **extra)


def test_mismatched_priority_list(make_llm):
    with pytest.raises(ValueError, match="2 priorities for 1 prompt;"):
        make_llm().generate([GOOD], priority=[1, 2])


# Trial 14d: priority=3 (an int) raised "TypeError: object of type 'int' has no len()"; a string was
# read one character a priority, and a dict or a set by its keys (accepted).
@pytest.mark.parametrize("priority, prompts, given", [
    (3, [GOOD], "an int; for one prompt give [3]"),
    (3, [GOOD, "Hello"], "an int"),
    ("34", [GOOD, "Hello"], "a str"),
    ({0: 1, 1: 2}, [GOOD, "Hello"], "a dict"),
    ({5}, [GOOD], "a set"),
    ((p for p in [1]), [GOOD], "a generator"),
])
def test_a_priority_that_is_not_a_list_is_one_line_naming_what_was_given(make_llm, priority, prompts, given):
    llm = make_llm()
    assert_refused_before_queueing(
        llm, rf"^priority must be a list of whole numbers, one per prompt, got {re.escape(given)}$",
        lambda: llm.generate(prompts, SamplingParams(max_tokens=2), priority=priority, use_tqdm=False))


# Trial 14d: llm.close(); llm.generate(...) ran as if nothing had happened.
def test_a_closed_llm_refuses_new_work_in_one_line(make_llm):
    llm = make_llm()
    with llm:
        assert llm.generate([GOOD], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    closed = r"^this LLM is closed; create a new LLM\(\.\.\.\)$"
    for call in (lambda: llm.generate([GOOD], SamplingParams(max_tokens=2), use_tqdm=False),
                 lambda: llm.generate(None),  # closed is said first, before the arguments are looked at
                 lambda: llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)):
        assert_refused_before_queueing(llm, closed, call)
    llm.close()  # idempotent
    assert llm.stats()["kv_blocks_used"] == 0 and llm.get_tokenizer() is not None  # these run nothing


def test_abort_frees_blocks_and_reports_abort(make_engine):
    engine = make_engine()
    rid = engine.add_request(GOOD, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    other = engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request(rid)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[rid].outputs[0].finish_reason == "abort"
    assert finished[other].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


def test_priority_requests_get_first_tokens_earlier(make_llm):
    """With a pool too small for all at once, higher-priority requests reach their first token in earlier steps."""
    llm = make_llm(num_kv_blocks=8, block_size=16, max_num_batched_tokens=64)
    prompts = [f"Request number {i} asks about the weather in a city far away. " * 3 for i in range(6)]
    priorities = [0, 0, 0, 10, 10, 10]  # the high ones arrive last
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        priority=priorities, use_tqdm=False)
    low = max(o.metrics.first_token_step for o, p in zip(outs, priorities) if p == 0)
    high = max(o.metrics.first_token_step for o, p in zip(outs, priorities) if p == 10)
    first_low = min(o.metrics.first_token_step for o, p in zip(outs, priorities) if p == 0)
    assert high < first_low <= low


def test_a_kv_pool_larger_than_free_memory_is_refused_before_allocating(make_engine):
    from nanovllm_core.config import available_memory_bytes
    import torch

    per_block = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2-135M, float32, 16-token blocks: layers x K/V x heads x dim x bytes x tokens
    too_many = available_memory_bytes(torch.device("cpu")) // per_block + 1
    with pytest.raises(ValueError, match=r"KV pool of \d+ blocks needs .* GiB .* lower num_kv_blocks"):
        make_engine(num_kv_blocks=too_many)


def test_cli_refuses_an_oversized_kv_pool_with_one_line(capsys, shared_default_loads):
    from nanovllm_core import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--prompt", "Hi", "--max-tokens", "1", "--num-kv-blocks", str(10**9)])
    assert e.value.code == 2 and shared_default_loads == [None]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lower num_kv_blocks" in err


def test_a_stop_string_that_is_not_valid_unicode_is_refused():
    """Trial 10: ``stop=["\\udfff"]`` was accepted by the server (a 200 with no stop ever found) while the
    same character in a prompt was a 400. SamplingParams refuses it, so the server, LLM and CLI do."""
    with pytest.raises(ValueError, match=r"^SamplingParams.stop contains a string that is not valid Unicode: "
                                         r"character 1 is a lone surrogate"):
        SamplingParams(stop=["ok", "x\udfff"])
    assert SamplingParams(stop="é\u00e9").stop == ["é\u00e9"]



def test_sampling_params_of_the_wrong_shape_are_named_as_given(make_llm):
    """Trial 10: one dict as sampling_params was called "sampling_params[0]", and LLM.chat with two
    params for one conversation spoke of "prompts"."""
    llm = make_llm()
    with pytest.raises(ValueError, match=r"^sampling_params must be a SamplingParams or a list of them \(one per "
                                         r"prompt\), not dict$"):
        llm.generate("Hi", {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^got 2 sampling params for 1 conversation; give one or one per "
                                         r"conversation$"):
        llm.chat([{"role": "user", "content": "Hi"}], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params\[1\] must be a SamplingParams, not int$"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1), 3], use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished_requests()


def test_vllms_prompt_dicts_are_taken_and_their_bad_forms_named(make_llm):
    """Trial 11: vLLM's TextPrompt / TokensPrompt dicts ({"prompt": ...}, {"prompt_token_ids": ...}) were
    refused as "a dict", though README says a vLLM script runs here."""
    llm = make_llm()
    sp = SamplingParams(temperature=0, max_tokens=2)
    ids = llm.get_tokenizer().encode("Hello there")
    plain = llm.generate(["Hello there", ids], sp, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert llm.generate({"prompt": "Hello there"}, sp, use_tqdm=False)[0].outputs[0].text == plain[0].outputs[0].text
    for prompt, message in [
        ({"prompt": "a", "multi_modal_data": {}}, r"^prompts\[0\] has 'multi_modal_data': a prompt dict here takes"),
        ({}, r"^prompts\[0\] must hold one of 'prompt' or 'prompt_token_ids', got an empty dict$"),
        ({"prompt_token_ids": "12"}, r"^prompts\[0\]\['prompt_token_ids'\] must be a list of token ids, got a str$"),
        ({"role": "user", "content": "Hi"}, r"^prompts\[0\] is a chat message; a conversation is a list of them"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0


def test_a_priority_under_fcfs_is_refused_as_vllm_refuses_it_at_every_library_entry_point(make_tiny_engine):
    """Trial 12: under scheduling_policy="fcfs" a priority other than 0 was accepted and ignored; vLLM
    refuses it ("Got priority 1 but Priority scheduling is not enabled"). One rule, the engine's."""
    from nanovllm_core import LLM
    from nanovllm_core.engine.controller import EngineController

    engine = make_tiny_engine(scheduling_policy="fcfs")
    llm = LLM.from_engine(engine)
    fix = "use scheduling_policy='priority' or priority 0"
    with pytest.raises(ValueError, match=r"priority\[0\] is 1, but the engine schedules fcfs") as e:
        llm.generate([GOOD, "Hello"], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    assert "\n" not in str(e.value) and str(e.value).endswith(fix)
    assert not engine.requests  # nothing queued
    with pytest.raises(ValueError, match=f"priority is -3, but the engine schedules fcfs.*{fix}"):
        engine.add_request(GOOD, SamplingParams(max_tokens=2), -3)
    out = llm.generate([GOOD], SamplingParams(max_tokens=2), priority=[0], use_tqdm=False)  # 0 is fcfs's own
    assert out[0].error is None
    controller = EngineController.from_engine(engine, start_paused=True)
    try:
        with pytest.raises(ValueError, match="priority is 5, but the engine schedules fcfs"):
            controller.submit(GOOD, SamplingParams(max_tokens=2), 5)
    finally:
        assert controller.shutdown(timeout=5.0)
    assert not engine.requests
    # the priority policy takes any priority in range
    assert LLM.from_engine(make_tiny_engine()).generate([GOOD], SamplingParams(max_tokens=2), priority=[7],
                                                   use_tqdm=False)[0].error is None
@pytest.mark.parametrize("device", ["tpu", "CPU", "mps", "cuda:x", "", 0, ["cpu"]])
def test_an_unknown_device_is_one_value_error_naming_the_field(device):
    """Issue 29, trial 12: torch's own error ("Expected one of cpu, cuda, ipu, xpu, ...") was a RuntimeError
    listing a score of device types this engine does not run on."""
    from nanovllm_core.config import EngineConfig

    with pytest.raises(ValueError, match=r"^device=.* is (unknown;|invalid:) use '?cpu'?, '?cuda'? or '?cuda:N'?") as e:
        EngineConfig(device=device)
    assert "\n" not in str(e.value) and "ipu" not in str(e.value)
    with pytest.raises(ValueError, match=r"^device='tpu' is unknown; use cpu, cuda or cuda:N"):
        LLM(device="tpu")


def test_a_cuda_device_this_machine_lacks_is_named_with_its_index(monkeypatch):
    import torch

    from nanovllm_core.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device='cuda:5' was asked for but no CUDA GPU is available; use "):
        EngineConfig(device="cuda:5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"^device='cuda:5' was asked for but this machine has 2 CUDA GPU\(s\) "
                                         r"\(cuda:0 to cuda:1\)"):
        EngineConfig(device="cuda:5")
    assert EngineConfig(device="cuda:1", quantization="none").device == "cuda:1"
    assert EngineConfig(device=torch.device("cpu")).torch_device.type == "cpu"


def test_kv_cache_memory_is_a_byte_count_with_a_64_bit_bound():
    """Issue 29, trial 12: kv_cache_memory shared the int32 bound of counts (2147483647), so no budget over
    2 GiB could be set, while the default on a GPU is half its free memory."""
    from nanovllm_core.config import EngineConfig

    assert EngineConfig(kv_cache_memory=40 * 2**30).kv_cache_memory == 40 * 2**30
    assert EngineConfig(kv_cache_memory=2**63 - 1).kv_cache_memory == 2**63 - 1
    for bad in (0, -5, 2**63, True, 1.5, "1GiB"):
        with pytest.raises(ValueError, match=r"^kv_cache_memory=.* is invalid: it must be a positive number of "
                                             r"bytes up to 9223372036854775807"):
            EngineConfig(kv_cache_memory=bad)


def test_a_kv_budget_below_one_block_is_refused_naming_the_block(make_tiny_engine):
    """Issue 29, trial 12: kv_cache_memory=1 silently became a one-block pool (720 KiB for SmolLM2)."""
    import re

    with pytest.raises(ValueError, match=r"^kv_cache_memory=1 bytes is smaller than one KV block of 16 tokens "
                                         r"\((\d+) bytes, [\d.]+ (KiB|MiB)\); give at least \d+, or size the pool "
                                         r"in blocks with num_kv_blocks \(--num-kv-blocks\)$") as e:
        make_tiny_engine(num_kv_blocks=None, kv_cache_memory=1, block_size=16)
    block = int(re.search(r"\((\d+) bytes", str(e.value)).group(1))
    with pytest.raises(ValueError, match=rf"kv_cache_memory={block - 1} bytes is smaller than one KV block"):
        make_tiny_engine(num_kv_blocks=None, kv_cache_memory=block - 1, block_size=16)
    assert make_tiny_engine(num_kv_blocks=None, kv_cache_memory=block, block_size=16).block_manager.num_blocks == 1
    assert make_tiny_engine(num_kv_blocks=None, kv_cache_memory=3 * block + 1, block_size=16) \
        .block_manager.num_blocks == 3


def test_num_kv_blocks_and_kv_cache_memory_together_are_refused():
    """Both size the pool; num_kv_blocks used to win and the byte budget was ignored without a word."""
    from nanovllm_core.config import EngineConfig

    with pytest.raises(ValueError, match=r"^num_kv_blocks=8 and kv_cache_memory=1048576 both size the KV pool .*"
                                         r"give only one of them$"):
        EngineConfig(num_kv_blocks=8, kv_cache_memory=2**20)


@pytest.mark.parametrize("model", ["", "   "])
def test_an_empty_model_name_is_refused_not_taken_for_the_default(model):
    """Issue 29, trial 12: LLM(model="") loaded the embedded default without a word; None (or leaving it
    out) is the way to ask for it."""
    from nanovllm_core.model.loader import ModelLoadError, resolve_model

    with pytest.raises(ValueError, match=r"^model=.* is invalid: name a Hugging Face repo id, a folder or a \.gguf "
                                         r"file, or leave it out \(None\) for the embedded default model$"):
        LLM(model=model)
    with pytest.raises(ModelLoadError, match=r"is empty; name a repo id, a folder or a \.gguf file, or pass None"):
        resolve_model(model)


def test_a_pool_whose_one_block_does_not_fit_names_block_size(monkeypatch):
    """Issue 29, trial 12: "a KV pool of 1 blocks needs 42.9 GiB ...; lower num_kv_blocks": the pool was one
    block already, so only a smaller block could help."""
    import torch

    from nanovllm_core import config

    monkeypatch.setattr(config, "available_memory_bytes", lambda device: 10 * 2**30)
    with pytest.raises(config.SettingError, match=r"^a KV pool of 1 block needs 43\.0 GiB \(44032\.00 MiB a block\) "
                                                  r"but only 10\.0 GiB of cpu memory is free; one block alone does "
                                                  r"not fit, so lower block_size \(--block-size\)$"):
        config.check_kv_pool_fits(1, 43 * 2**30, torch.device("cpu"))
    with pytest.raises(config.SettingError, match=r"^a KV pool of 100 blocks needs .*; lower num_kv_blocks "
                                                  r"\(--num-kv-blocks\) or kv_cache_memory$"):
        config.check_kv_pool_fits(100, 2**30, torch.device("cpu"))
    config.check_kv_pool_fits(4, 2**30, torch.device("cpu"))


def test_a_block_longer_than_a_sequence_is_refused_saying_what_to_use(make_tiny_engine):
    from nanovllm_core.config import EngineConfig, SettingError

    with pytest.raises(SettingError, match=r"^block_size=100 is longer than max_model_len \(64 tokens\), and a block "
                                           r"holds tokens of one sequence; use block_size 64 or less \(--block-size\)$"):
        EngineConfig(block_size=100, max_model_len=64)
    with pytest.raises(SettingError, match=r"^block_size=1000000 is longer than max_model_len \(\d+ tokens\).* "
                                           r"use block_size \d+ or less \(--block-size\)$"):
        make_tiny_engine(block_size=10**6)
    assert make_tiny_engine(block_size=64, max_model_len=64).block_manager.block_size == 64


def test_a_context_longer_than_the_models_says_what_to_use(tiny_llama_dir):
    import torch

    from nanovllm_core.engine.controller import load_failure
    from nanovllm_core.model.loader import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match=r"^max_model_len=10000000 is longer than the model's context \((\d+) "
                                             r"tokens\); use max_model_len \1 or less \(--max-model-len\), or leave it "
                                             r"out for the whole context$") as e:
        load_model(str(tiny_llama_dir), torch.device("cpu"), torch.float32, max_model_len=10**7)
    # a setting, not a model that failed: the app and `nanovllm serve` say so
    assert load_failure(e.value).startswith("engine setting refused: max_model_len=10000000")
    assert load_failure(ModelLoadError("no such model")) == "model failed to load: no such model"
    assert load_failure(ValueError("device='tpu' is unknown")).startswith("engine setting refused: ")
    assert load_failure(RuntimeError("boom")) == "model failed to load: boom"


# Trial 13: messages named only the Python setting ("raise num_kv_blocks", "speculative_model='ngram'")
# where a CLI, server or app user sets an option, and said "the pool has 1 blocks". The library's name
# stays first; the option follows in parentheses, as the pool-memory messages already did.
def test_setting_advice_names_the_option_beside_the_setting_and_one_block_is_singular(make_tiny_engine):
    from nanovllm_core.config import EngineConfig
    from nanovllm_core.educational.narrator import Narrator

    with pytest.raises(ValueError, match=r"speculative_model='ngram' \(--speculative-model ngram\)$"):
        EngineConfig(num_speculative_tokens=3)
    engine = make_tiny_engine(num_kv_blocks=2, block_size=16)
    field, reason = engine.request_problem([5] * 20, SamplingParams(max_tokens=100))
    assert field == "max_tokens" and reason.endswith("raise num_kv_blocks (--num-kv-blocks) or lower max_tokens"), reason
    field, reason = engine.request_problem([5] * 40, SamplingParams(max_tokens=1))
    assert field == "prompt" and reason.endswith("shorten the prompt or raise num_kv_blocks (--num-kv-blocks)"), reason
    field, reason = engine.request_problem([5] * 4, SamplingParams(max_tokens=1, n=10**4))
    assert field == "n" and reason.endswith("raise max_num_seqs (--max-num-seqs)"), reason
    info = {"model_name": "M", "num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": 16, "vocab_size": 100, "kv_bytes_per_token": 256, "num_kv_blocks": 1, "block_size": 16}
    [note] = Narrator(model_info=info).introduction()
    assert "the pool has 1 block of 16 tokens" in note.text, note.text


def test_errors_quote_a_long_request_id_or_template_error_short(make_tiny_engine):
    """fix15f's note: the library's duplicate-id error and the chat template's error quoted the whole value
    (the server's ids are 128 characters at most, the library's any length)."""
    engine = make_tiny_engine()
    long_id = "r" * 100_000
    engine.add_request(GOOD, SamplingParams(max_tokens=1), request_id=long_id)
    with pytest.raises(ValueError) as e:
        engine.add_request(GOOD, SamplingParams(max_tokens=1), request_id=long_id)
    assert "is already in use" in str(e.value) and len(str(e.value)) < 200 and "100000 characters" in str(e.value)
    engine.abort_request(long_id)
    with pytest.raises(ValueError) as e:
        engine.select_xray("q" * 100_000)
    assert "to X-Ray" in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("speculative", [False, True])
def test_a_request_whose_kv_fits_the_pool_exactly_runs(make_tiny_engine, speculative):
    """Trial 29d: 5 prompt + 12 output tokens was refused a one-block (16-slot) pool, "may need 2 KV blocks
    (17 tokens)", though the last sampled token's K/V is never stored: 16 slots hold it. A prompt of a whole
    block runs with max_tokens=1; one token more is refused, naming the prompt. The contiguous baseline
    reserves prompt + max_tokens up front, so there the same request is refused."""
    spec = {"speculative_model": "ngram", "num_speculative_tokens": 4} if speculative else {}
    engine = make_tiny_engine(num_kv_blocks=1, block_size=16, **spec)
    greedy = dict(temperature=0, ignore_eos=True)
    for prompt, max_tokens in (([7] * 5, 12), ([7] * 16, 1), ([7] * 1, 16)):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **greedy))
        finished = []
        for _ in range(100):
            finished += [o for o in engine.step() if o.finished]
            if not engine.has_unfinished_requests():
                break
        assert [(o.request_id, len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in finished] == \
            [(rid, max_tokens, "length")]
        assert engine.block_manager.num_used_blocks == 0
    refused = engine.request_problem([7] * 5, SamplingParams(max_tokens=13, **greedy))
    assert refused is not None and refused[0] == "max_tokens" and "2 KV blocks (K/V of 17 tokens)" in refused[1], refused
    refused = engine.request_problem([7] * 17, SamplingParams(max_tokens=1, **greedy))
    assert refused is not None and refused[0] == "prompt" and "the prompt has 17 tokens, whose K/V needs 2" in refused[1]
    if not speculative:
        contiguous = make_tiny_engine(num_kv_blocks=1, block_size=16, paged=False)
        refused = contiguous.request_problem([7] * 5, SamplingParams(max_tokens=12, **greedy))
        assert refused is not None and "reserves 2 KV blocks up front (17 token slots: its prompt + max_tokens" \
            in refused[1] and "may need" not in refused[1], refused  # it never stores 17: it reserves (trial 35e)

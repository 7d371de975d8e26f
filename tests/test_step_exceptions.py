"""An exception inside a step (trial 21c): a fault is isolated (each sequence retried alone) and now
said as a RuntimeWarning where a plain ``LLM.generate`` caller sees it; a caller's time limit
(``TimeoutError``, e.g. raised by a ``signal.alarm`` handler) reaches the caller, as Ctrl-C does,
with no request or KV block left behind. Before, both were swallowed and generate ran on."""

from __future__ import annotations

import pytest

from nanovllm_core import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def fail_at(step: int, error: Exception):
    def inject(plan):
        if plan.step == step:
            raise error
    return inject


def test_an_isolated_fault_is_said_and_the_requests_finish(make_tiny_engine):
    engine = make_tiny_engine(num_kv_blocks=64)
    engine.fault_injector = fail_at(2, ValueError("injected fault"))
    with pytest.warns(RuntimeWarning, match=r"step 2 raised ValueError: injected fault; each of its 2 sequence"):
        outs = LLM.from_engine(engine).generate(["Once upon a time", "Hello"], PARAMS, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]  # the retries alone succeeded


def test_a_timeout_raised_inside_a_step_reaches_the_caller_and_leaves_nothing(make_tiny_engine):
    engine = make_tiny_engine(num_kv_blocks=64)
    llm = LLM.from_engine(engine)
    engine.fault_injector = fail_at(engine.step_index + 2, TimeoutError("time is up"))
    with pytest.raises(TimeoutError, match="time is up"):
        llm.generate(["Once upon a time", "Hello"], PARAMS, use_tqdm=False)
    engine.fault_injector = None
    assert llm.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished_requests()
    again = llm.generate(["Hello"], PARAMS, use_tqdm=False)  # the engine goes on
    assert again[0].outputs[0].finish_reason == "length"

"""Every token one step makes carries the step's one time (trial 16a bug 5).

The time was taken per token while the step's outputs were processed, so on a busy host a slow
listener or detokenizer made later requests of the same forward pass look up to 45 ms slower
(TTFT, TPOT, E2E). vLLM V1 stamps an iteration's outputs with one time
(``IterationStats.iteration_timestamp``). Here a listener sleeps on every token: the tokens of
one step must still share one time, in the events and in the ``RequestOutput`` metrics.
No timed assertion: only equality of stamps, and that the sleeps did happen between them.
"""

from __future__ import annotations

import time
from collections import defaultdict

from nanovllm_core import events as ev
from nanovllm_core.engine import output_processor
from nanovllm_core.sampling_params import SamplingParams

SLEEP_S = 0.01


def _run(engine, prompts, params):
    seen: list[ev.Event] = []

    def slow_listener(e: ev.Event) -> None:
        seen.append(e)
        if isinstance(e, ev.TokenSampled):
            time.sleep(SLEEP_S)  # a busy host: each request's output takes a while to hand on

    engine.subscribe(slow_listener, topk=0, blocks=False)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return ids, outputs, seen


def _check_one_time_a_step(seen, min_per_step=2):
    by_step: dict[int, set[float]] = defaultdict(set)
    counts: dict[int, int] = defaultdict(int)
    for e in seen:
        if isinstance(e, (ev.TokenSampled, ev.SpecDecodeStep)):
            by_step[e.step].add(e.time)
            counts[e.step] += isinstance(e, ev.TokenSampled)
    assert any(n >= min_per_step for n in counts.values())  # several tokens in one step were slowed
    for step, times in by_step.items():
        assert len(times) == 1, f"step {step}: its tokens carry {len(times)} times"
    finished = [e for e in seen if isinstance(e, ev.RequestFinished)]
    last_token = {e.request_id: e.time for e in seen if isinstance(e, ev.TokenSampled)}
    for f in finished:  # a request ends at its last token's step: the same time
        assert f.time == last_token[f.request_id]
    return by_step


def test_tokens_of_one_step_share_its_time_despite_a_slow_listener(make_tiny_engine):
    engine = make_tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids, outputs, seen = _run(engine, ["one two", "three four five", "six"], params)
    _check_one_time_a_step(seen, min_per_step=3)
    metrics = [outputs[i].metrics for i in ids]
    # one prefill step and the same decode steps for all three: equal times, though each token slept 10 ms
    assert len({m.first_token_time for m in metrics}) == 1
    assert len({m.last_token_time for m in metrics}) == 1
    assert len({m.finished_time for m in metrics}) == 1
    assert len({m.time_per_output_token for m in metrics}) == 1
    first = {e.request_id: e.ttft_s for e in seen if isinstance(e, ev.TokenSampled) and e.num_output_tokens == 1}
    assert first == {i: outputs[i].metrics.time_to_first_token for i in ids}  # the events tell the same TTFT
    steps = sorted({e.step for e in seen if isinstance(e, ev.TokenSampled)})
    stamps = [next(e.time for e in seen if isinstance(e, ev.TokenSampled) and e.step == s) for s in steps]
    # the 3 x 10 ms of sleeps fell between two steps' stamps, not inside one
    assert all(b - a >= 3 * SLEEP_S for a, b in zip(stamps, stamps[1:]))


def test_a_slow_detokenizer_does_not_spread_one_steps_times(make_tiny_engine, monkeypatch):
    real = output_processor.detokenize_new_token

    def slow(tokenizer, seq):
        time.sleep(SLEEP_S)
        return real(tokenizer, seq)

    monkeypatch.setattr(output_processor, "detokenize_new_token", slow)
    engine = make_tiny_engine()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids, outputs, seen = _run(engine, ["alpha beta", "gamma"], params)
    _check_one_time_a_step(seen)
    a, b = (outputs[i].metrics for i in ids)
    assert (a.first_token_time, a.last_token_time, a.finished_time) == (b.first_token_time, b.last_token_time,
                                                                         b.finished_time)


def test_a_speculative_steps_several_tokens_share_its_time(make_tiny_engine):
    engine = make_tiny_engine(speculative_model="target", num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    ids, outputs, seen = _run(engine, ["one two three", "four five"], params)
    by_step = _check_one_time_a_step(seen, min_per_step=4)  # a verification keeps up to 4 tokens per request
    assert any(isinstance(e, ev.SpecDecodeStep) for e in seen)
    assert len(by_step) >= 2
    a, b = (outputs[i].metrics for i in ids)
    assert a.first_token_time == b.first_token_time


def test_an_abort_outside_a_step_is_timed_when_it_happens(make_tiny_engine):
    engine = make_tiny_engine()
    seen: list[ev.Event] = []
    engine.subscribe(seen.append, topk=0, blocks=False)
    rid = engine.add_request("one two", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    token_time = next(e.time for e in seen if isinstance(e, ev.TokenSampled))
    time.sleep(SLEEP_S)
    assert engine.abort_request(rid)
    finished = next(e for e in seen if isinstance(e, ev.RequestFinished))
    assert finished.time > token_time  # not some step's stamp

"""Newcomer trial 24b: an ``n=3`` request aborted while it waited showed one ``RequestFinished`` on the
event stream where ``/metrics`` counted three aborted samples. The stream sends one event per
request (docs/serving.md now says so); the event must list every sample with its own reason."""

from __future__ import annotations

from nanovllm_core import SamplingParams
from nanovllm_core import events as ev


def test_an_n_request_aborted_while_waiting_finishes_once_with_every_sample_listed(make_tiny_engine):
    engine = make_tiny_engine(num_kv_blocks=64)
    seen: list[ev.Event] = []
    engine.subscribe(seen.append, topk=0)
    engine.add_request("hi there you", SamplingParams(max_tokens=5, n=3), request_id="r")
    assert engine.abort_request("r")
    (done,) = [e for e in seen if isinstance(e, ev.RequestFinished)]
    assert [(s.index, s.finish_reason) for s in done.samples] == [(0, "abort"), (1, "abort"), (2, "abort")]
    (out,) = engine.pop_finished_outputs()
    assert [o.finish_reason for o in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0

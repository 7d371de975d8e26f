"""The engine's observer hook (engine/observer.py): how the X-Ray sees each layer without the
engine importing it. A stand-in observer shows the contract; the installed plug is the X-Ray."""

from __future__ import annotations

import pytest

from nanovllm_core.engine import observer
from nanovllm_core.sampling_params import SamplingParams


class RecordingTracer:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def embedding(self, input_ids, x):
        self.calls.append(("embedding", tuple(input_ids.shape), tuple(x.shape)))

    def layer_input(self, layer, x):
        self.calls.append(("layer_input", layer))

    def qkv(self, layer, x, q, k, v, attn=None):
        self.calls.append(("qkv", layer, tuple(q.shape), tuple(k.shape)))

    def attention_output(self, layer, out):
        self.calls.append(("attention_output", layer))

    def mlp(self, layer, x, gate, up, act, out):
        self.calls.append(("mlp", layer, tuple(gate.shape)))

    def layer_output(self, layer, mid, out):
        self.calls.append(("layer_output", layer))


class RecordingObserver:
    def __init__(self, engine, prepare: bool) -> None:
        self.engine, self.prepared, self.selected, self.plans = engine, int(prepare), [], []
        self.tracer = RecordingTracer()

    def tracer_for(self, plan):
        self.plans.append(plan.step)
        return self.tracer

    def select(self, request_id, layer=0, head=0):
        self.selected.append((request_id, layer, head))

    def prepare(self):
        self.prepared += 1


@pytest.fixture
def recording_plug():
    made: list[RecordingObserver] = []
    plug = observer.ObserverPlug(make=lambda engine, prepare: made.append(RecordingObserver(engine, prepare)) or made[-1],
                                 facts=lambda engine: {"observer_fact": 42})
    previous = observer.install(plug)
    try:
        yield made
    finally:
        observer.install(previous)


def test_an_installed_observer_gets_a_tracer_into_every_layer_of_a_step(make_tiny_engine, recording_plug):
    engine = make_tiny_engine()
    assert recording_plug == []  # nobody asked for traces: no observer is made
    engine.subscribe(lambda e: None, topk=0, xray=True)
    (obs,) = recording_plug
    assert obs.engine is engine and obs.prepared == 1  # made between steps, so it may do slow work then
    engine.add_request("Hello there", SamplingParams(max_tokens=2, temperature=0.0), request_id="r0")
    engine.select_xray("r0", layer=1)  # a known request's id (an unknown one is refused)
    assert obs.selected == [("r0", 1, 0)]
    while engine.has_unfinished_requests():
        engine.step()
    cfg = engine.model_config
    layers = [c[1] for c in obs.tracer.calls if c[0] == "layer_output"]
    assert obs.plans and layers[:cfg.num_hidden_layers] == list(range(cfg.num_hidden_layers))
    first = obs.tracer.calls[0]
    assert first[0] == "embedding" and first[2][1] == cfg.hidden_size
    qkv = next(c for c in obs.tracer.calls if c[0] == "qkv")
    assert qkv[2][1:] == (cfg.num_attention_heads, cfg.head_dim) and qkv[3][1:] == (cfg.num_key_value_heads, cfg.head_dim)
    assert engine.model_info()["observer_fact"] == 42


def test_without_an_installed_observer_asking_for_traces_says_why(make_tiny_engine):
    previous = observer.install(None)
    try:
        engine = make_tiny_engine()
        with pytest.raises(RuntimeError, match="no layer observer is installed"):
            engine.subscribe(lambda e: None, xray=True)
        assert engine._subscribers == []  # refused whole: no half-made subscription left to fail in a step
        assert "num_layers" in engine.model_info()  # the engine's own facts need no observer
    finally:
        observer.install(previous)


def test_the_package_installs_the_xray_as_the_observer(make_tiny_engine):
    from nanovllm_core.educational.xray import XRayCapture

    engine = make_tiny_engine()
    capture = observer.installed().make(engine, False)  # False: no roofline measurement here
    assert isinstance(capture, XRayCapture) and capture.engine is engine
    assert XRayCapture.prepare is XRayCapture.measure_roofline

"""The event contract: ordering invariants, X-Ray content, JSON round-trips, Chrome traces."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nanovllm_core import SamplingParams
from nanovllm_core import events as ev
from nanovllm_core.tracing import chrome_trace

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "Hi", "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z " * 2, ""]


@pytest.fixture(scope="module")
def recorded(make_llm):
    """Events of a small run with preemption, chunking, a rejection and X-Ray on."""
    llm = make_llm(num_kv_blocks=10, block_size=8, max_num_batched_tokens=24)
    events: list[ev.Event] = []
    llm.engine.subscribe(events.append, topk=5, blocks=True, xray=True)
    llm.engine.select_xray(None, layer=2, head=4, every_layer=True)  # as the CLI's --xray: all layers
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        reject_bad_prompts=True)  # the empty prompt is reported as a rejection, as the CLI does
    return llm, events, outs


def test_every_added_request_ends_exactly_once(recorded):
    _, events, _ = recorded
    added = [e.request_id for e in events if isinstance(e, ev.RequestAdded)]
    ended = [e.request_id for e in events if isinstance(e, (ev.RequestFinished, ev.RequestRejected))]
    rejected = [e.request_id for e in events if isinstance(e, ev.RequestRejected)]
    assert len(rejected) == 1  # the empty prompt
    assert sorted(ended) == sorted(added + rejected)
    for rid in added:
        assert ended.count(rid) == 1
        first_added = next(i for i, e in enumerate(events) if isinstance(e, ev.RequestAdded) and e.request_id == rid)
        first_end = next(i for i, e in enumerate(events) if isinstance(e, ev.RequestFinished) and e.request_id == rid)
        assert first_added < first_end


def test_step_indices_are_contiguous_and_timed(recorded):
    _, events, _ = recorded
    steps = [e.step for e in events if isinstance(e, ev.StepPlanned)]
    assert steps == list(range(steps[0], steps[0] + len(steps)))
    timed = {e.step for e in events if isinstance(e, ev.StepTimed)}
    planned_nonempty = {e.step for e in events if isinstance(e, ev.StepPlanned) and e.scheduled}
    assert planned_nonempty == timed
    assert any(e.preempted for e in events if isinstance(e, ev.StepPlanned)), "the small pool should preempt"
    assert all(e.num_batched_tokens <= e.token_budget for e in events if isinstance(e, ev.StepPlanned))


def test_token_events_reproduce_each_output(recorded):
    _, events, outs = recorded
    for out in outs:
        if out.error:
            continue
        tokens = [e.token_id for e in events if isinstance(e, ev.TokenSampled) and e.request_id == out.request_id]
        assert tokens == out.outputs[0].token_ids
        text = "".join(e.text for e in events if isinstance(e, ev.TokenSampled) and e.request_id == out.request_id)
        assert text == out.outputs[0].text


def test_blocks_snapshot_is_consistent(recorded):
    _, events, _ = recorded
    for e in events:
        if isinstance(e, ev.BlocksChanged):
            owners = e.owners()
            for b, state in enumerate(e.states):
                assert (state == "u") == (e.ref_counts[b] > 0)
                assert len(owners.get(b, [])) == e.ref_counts[b]


def test_xray_shapes_follow_the_model_config(recorded):
    llm, events, _ = recorded
    cfg = llm.engine.model_config
    traces = [e for e in events if isinstance(e, ev.LayerTrace)]
    assert traces
    first_step = traces[0].step
    layers = [t for t in traces if t.step == first_step]
    assert [t.layer for t in layers] == list(range(cfg.num_hidden_layers))
    t = layers[0]
    tensors = {x.name: x.shape for x in t.tensors}
    n = t.num_batch_tokens  # the step's flat batch: every scheduled sequence's tokens
    assert tensors["attn_norm"] == (n, cfg.hidden_size)
    assert tensors["q"] == (n, cfg.num_attention_heads, cfg.head_dim) == (n, 9, 64)
    assert tensors["k"] == (n, cfg.num_key_value_heads, cfg.head_dim) == (n, 3, 64)
    assert tensors["gate"] == (n, cfg.intermediate_size)
    assert t.kv_bytes_per_token == 2 * cfg.num_hidden_layers * 3 * 64 * 4
    ops = {o.name: o for o in t.ops}
    assert ops["attention"].math.startswith("O = softmax(Q K^T / sqrt(64)")
    assert ops["qkv_proj"].flops == 2 * n * 576 * (9 + 6) * 64


def test_xray_attention_weights_sum_to_one(recorded):
    _, events, _ = recorded
    heat = [e for e in events if isinstance(e, ev.LayerTrace) and e.attention]
    assert heat and all(h.layer == 2 and h.head == 4 for h in heat)
    for h in heat:
        for row in h.attention:
            if len(row) == len(h.key_pieces) and h.key_pieces:  # the row holds all its keys
                assert abs(sum(row) - 1.0) < 1e-3


def test_every_event_type_round_trips_through_json(recorded):
    _, events, _ = recorded
    extra = [
        ev.SpecDecodeStep(step=3, request_id="r", seq_id=1, proposer="ngram", draft_tokens=(5, 6), draft_texts=("a", "b"),
                          p=(0.5, 0.1), q=(1.0, 1.0), accepted=(True, False), bonus_token=9, bonus_text="c"),
        ev.ModelLoading(stage="converting GGUF", done=3, total=10),
        ev.EnginePaused(step=4), ev.EngineResumed(step=4),
        ev.EngineError(step=None, message="boom", request_id="x"),
    ]
    seen = set()
    for e in events + extra:
        back = ev.from_json(ev.to_json(e))
        assert back == e, type(e).__name__
        seen.add(type(e).__name__)
    contract = {"RequestAdded", "RequestRejected", "RequestFinished", "StepPlanned", "TokenSampled", "BlocksChanged",
                "StepTimed", "LayerTrace", "SpecDecodeStep", "ModelLoading", "EnginePaused", "EngineResumed",
                "EngineError"}
    assert contract <= seen


def test_from_json_rejects_non_events():
    with pytest.raises(ValueError, match="not an engine event"):
        ev.from_json('{"type": "Nope"}')


def test_chrome_trace_has_required_fields(recorded, tmp_path):
    _, events, _ = recorded
    trace = json.loads(json.dumps(chrome_trace(events)))
    items = trace["traceEvents"]
    assert items
    for item in items:
        assert {"name", "ph", "pid", "tid"} <= set(item)
        if item["ph"] in ("X", "i"):
            assert isinstance(item["ts"], (int, float))
        if item["ph"] == "X":
            assert item["dur"] > 0
    names = {i["name"] for i in items}
    assert {"queued", "prefill chunk", "decode", "preempted", "rejected"} <= names
    assert any(n.startswith("finished") for n in names) and any(n.startswith("step ") for n in names)


def test_events_are_frozen():
    e = ev.EnginePaused(step=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.step = 2


def test_no_event_field_hides_the_event_type_name():
    """``Event.kind`` names the event's class; a dataclass field called ``kind`` would shadow it
    (a LayerTrace once reported kind "prefill", and trace readers lost every one of them)."""
    import dataclasses

    events = {name: cls for name, cls in ev.EVENT_TYPES.items() if issubclass(cls, ev.Event)}
    assert "LayerTrace" in events and "ScheduledEntry" not in events  # a plan's entries are not events
    for name, cls in events.items():
        assert "kind" not in {f.name for f in dataclasses.fields(cls)}, name


def test_a_layer_trace_written_with_the_old_field_name_still_loads():
    trace = ev.LayerTrace(step=0, request_id="0", layer=0, num_layers=1, tensors=(), ops=(), num_heads=1,
                          num_kv_heads=1, head_dim=4, hidden_size=4, kv_bytes_per_token=32, part="decode")
    old = ev.to_json(trace).replace('"part":', '"kind":')
    back = ev.from_json(old)
    assert back.kind == "LayerTrace" and back.part == "decode"


def _wrong_for(tp) -> list:
    """JSON values that a field declared ``tp`` must refuse (an object without a type fits none but Any)."""
    import typing

    wrong = [{"no": "type"}]
    if tp is int:
        wrong += ["3", 3.0, True]
    elif tp is float:
        wrong += ["BOGUS", True]
    elif tp is str:
        wrong += [5, None]
    elif tp is bool:
        wrong += [1, "true"]
    elif typing.get_origin(tp) is tuple:
        wrong += ["1,2", 5]
    return wrong


def test_every_field_of_every_event_type_is_checked_against_its_declared_type(recorded):
    """Trial 14a: a trace line whose fields have the wrong types (a StepTimed with time "BOGUS") was
    read as an event and crashed the replay's app later. Each field is checked on reading, from the
    dataclasses' own annotations, and the error names the event and field."""
    import typing

    _, events, _ = recorded
    extra = [ev.SpecDecodeStep(step=3, request_id="r", seq_id=1, proposer="ngram", draft_tokens=(5,), draft_texts=("a",),
                               p=(0.5,), q=(1.0,), accepted=(True,), bonus_token=9),
             ev.ModelLoading(stage="converting GGUF", done=3, total=10), ev.EnginePaused(step=4),
             ev.EngineResumed(step=4), ev.EngineError(step=None, message="boom")]
    one_of_each = {type(e): e for e in events + extra}
    assert {cls for cls in ev.EVENT_TYPES.values() if issubclass(cls, ev.Event)} <= set(one_of_each)
    for cls, event in one_of_each.items():
        data = json.loads(ev.to_json(event))
        for name, tp in typing.get_type_hints(cls).items():
            for bad in _wrong_for(tp):
                line = json.dumps({**data, name: bad})
                with pytest.raises(ev.FieldTypeError) as refused:
                    ev.from_json(line)
                assert str(refused.value).startswith(f"{cls.__name__}.{name} must be "), (line[:200], refused.value)


def test_a_wrong_type_is_named_with_its_field_path_and_value():
    timed = ev.StepTimed(step=1, wall_time_s=0.1, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
                         prefill_tokens_per_s=0.0, decode_tokens_per_s=10.0, kv_bytes_used=0, kv_bytes_total=1,
                         num_running=1, num_waiting=0)
    bogus = json.dumps({k: (v if k == "type" else "BOGUS") for k, v in json.loads(ev.to_json(timed)).items()})
    with pytest.raises(ValueError, match='^StepTimed.time must be a number, got "BOGUS"$'):
        ev.from_json(bogus)
    entry = ev.ScheduledEntry(request_id="r", seq_id=0, index=0, kind="prefill", num_tokens=4, start=0, prompt_len=4,
                              total_len=4, num_cached_tokens=0, samples=True, priority=0)
    plan = ev.StepPlanned(step=0, token_budget=8, num_batched_tokens=4, scheduled=(entry,), preempted=(), admitted=(),
                          waiting=(), running=(), max_num_seqs=4)
    line = ev.to_json(plan).replace('"num_tokens":4', '"num_tokens":"4"')
    with pytest.raises(ValueError, match=r'^StepPlanned.scheduled\[0\].num_tokens must be a whole number, got "4"$'):
        ev.from_json(line)
    line = ev.to_json(plan).replace('"type":"ScheduledEntry"', '"type":"QueueEntry"')
    with pytest.raises(ValueError, match=r"^StepPlanned.scheduled\[0\] must be a ScheduledEntry object, got "):
        ev.from_json(line)


def test_nan_comes_back_as_nan_where_a_field_may_hold_it_and_optional_numbers_as_none():
    import math

    tensor = ev.TensorInfo(name="x", shape=(1, 3), sample=(math.nan, math.inf, -1.5))  # the forward pass's own values
    back = ev.from_json(json.dumps(json.loads(ev.to_json(ev.RequestFinished(
        request_id="r", step=1, index=0, finish_reason="stop", stop_reason=None, output_text="", output_token_ids=(),
        num_prompt_tokens=1, num_output_tokens=0, ttft_s=None, tpot_s=None, e2e_s=None, num_preemptions=0,
        num_cached_prompt_tokens=0)))))
    assert back.ttft_s is None
    part = ev._build(ev.TensorInfo, json.loads(ev.to_json(tensor)))  # to_json writes NaN as null; read back as NaN
    assert math.isnan(part.sample[0]) and part.sample[1:] == (math.inf, -1.5)


def _timed(**changes) -> str:
    timed = ev.StepTimed(step=1, wall_time_s=0.1, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
                         prefill_tokens_per_s=0.0, decode_tokens_per_s=10.0, kv_bytes_used=0, kv_bytes_total=1,
                         num_running=1, num_waiting=0, num_blocks_used=1, num_blocks_total=4)
    return json.dumps({**json.loads(ev.to_json(timed)), "time": 1.0, **changes})  # a fixed time: the same test id each run


def _sampled(prob, **changes) -> str:
    top = {"type": "TopToken", "token_id": 1, "text": "a", "prob": prob}
    sampled = ev.TokenSampled(step=0, request_id="r", seq_id=0, index=0, token_id=1, text="a", position=0,
                              num_output_tokens=1)
    return json.dumps({**json.loads(ev.to_json(sampled)), "time": 1.0, "top": [top], **changes})


@pytest.mark.parametrize("line, message", [
    # report 15b, finding 1: NaN and infinities passed as "a number" and crashed the app while it drew them
    (_timed(yielded_s=math.nan), "StepTimed.yielded_s must be a finite number >= 0, got NaN"),
    (_timed(yielded_s=math.inf), "StepTimed.yielded_s must be a finite number >= 0, got Infinity"),
    (_timed(wall_time_s=None), "StepTimed.wall_time_s must be a finite number >= 0, got null"),
    (_timed(decode_tokens_per_s=-math.inf), "StepTimed.decode_tokens_per_s must be a finite number >= 0, got -Infinity"),
    (_timed(time=math.nan), "StepTimed.time must be a finite number >= 0, got NaN"),
    (_timed(tp_forward_s=[0.1, math.nan]), "StepTimed.tp_forward_s[1] must be a finite number >= 0, got NaN"),
    (_sampled(math.nan), "TokenSampled.top[0].prob must be a number from 0 to 1, got NaN"),
    (_sampled(None), "TokenSampled.top[0].prob must be a number from 0 to 1, got null"),
    # report 15b, finding 3: impossible values drawn as facts
    (_sampled(-3.0), "TokenSampled.top[0].prob must be a number from 0 to 1, got -3.0"),
    (_sampled(1.5), "TokenSampled.top[0].prob must be a number from 0 to 1, got 1.5"),
    (_timed(num_blocks_used=-3), "StepTimed.num_blocks_used must be >= 0, got -3"),
    (_timed(step=-1), "StepTimed.step must be >= 0, got -1"),
    (_timed(tp_size=0), "StepTimed.tp_size must be >= 1, got 0"),
    (_timed(wall_time_s=-0.5), "StepTimed.wall_time_s must be a finite number >= 0, got -0.5"),
    (_sampled(0.5, position=-1), "TokenSampled.position must be >= 0, got -1"),
    (_sampled(0.5, logprob=0.5), "TokenSampled.logprob must be a finite number <= 0, got 0.5"),
    ('{"type":"StepPlanned","step":7,"token_budget":-5,"num_batched_tokens":2,"scheduled":[],"preempted":[],'
     '"admitted":[],"waiting":[],"running":[],"max_num_seqs":4}', "StepPlanned.token_budget must be >= 0, got -5"),
    ('{"type":"BlocksChanged","step":1,"block_size":0,"bytes_per_block":8,"states":"uf","ref_counts":[1,0],"tables":[]}',
     "BlocksChanged.block_size must be >= 1, got 0"),
    ('{"type":"BlocksChanged","step":1,"block_size":16,"bytes_per_block":8,"states":"uf","ref_counts":[1,-1],'
     '"tables":[]}', "BlocksChanged.ref_counts[1] must be >= 0, got -1"),
    ('{"type":"RequestFinished","request_id":"r","step":-2,"index":0,"finish_reason":"stop","stop_reason":-7,'
     '"output_text":"","output_token_ids":[],"num_prompt_tokens":1,"num_output_tokens":0,"ttft_s":null,"tpot_s":null,'
     '"e2e_s":null,"num_preemptions":0,"num_cached_prompt_tokens":0}', "RequestFinished.step must be >= 0, got -2"),
    ('{"type":"RequestFinished","request_id":"r","step":2,"index":0,"finish_reason":"stop","stop_reason":-7,'
     '"output_text":"","output_token_ids":[],"num_prompt_tokens":1,"num_output_tokens":0,"ttft_s":-1,"tpot_s":null,'
     '"e2e_s":null,"num_preemptions":0,"num_cached_prompt_tokens":0}', "RequestFinished.stop_reason must be >= 0, got -7"),
])
def test_a_number_its_field_never_holds_is_refused_naming_the_field_and_rule(line, message):
    with pytest.raises(ev.FieldTypeError) as refused:
        ev.from_json(line)
    assert str(refused.value) == message


def test_the_values_the_engine_makes_outside_the_default_rules_are_taken():
    """A priority is any whole number (vLLM's), a refused request's max_tokens is what it asked, and a
    probability of exactly 0 or 1 is one."""
    added = ev.RequestAdded(request_id="r", prompt="x", prompt_token_ids=(1,), prompt_pieces=("x",), priority=-5,
                            max_tokens=4)
    assert ev.from_json(ev.to_json(added)).priority == -5
    rejected = ev.RequestRejected(request_id="r", reason="max_tokens must be >= 1", priority=-1, max_tokens=-3)
    assert ev.from_json(ev.to_json(rejected)).max_tokens == -3
    assert [t.prob for t in ev.from_json(_sampled(1)).top] == [1] and ev.from_json(_sampled(0.0)).top[0].prob == 0.0


@pytest.mark.parametrize("line, message", [
    ('{"type":"StepTimed","time":1.5,"st', "not complete JSON, cut short or corrupted (it stops after 34 characters)"),
    ('{"type":"EnginePaused","time":1.5,"step":3\n', "not complete JSON, cut short or corrupted (it stops after 42 "),
    ('{"type":"EnginePaused" "time":1}', "not complete JSON, cut short or corrupted (it goes wrong at character 24 of"),
    ("hello", "not JSON (Expecting value at character 1); a trace holds one engine event, a JSON object, a line"),
])
def test_a_line_that_is_not_whole_json_says_so_not_what_json_guessed(line, message):
    """Trial 14a: a line cut mid-file was reported as json's "Invalid control character at: line 1 column 51"."""
    with pytest.raises(ValueError) as refused:
        ev.from_json(line)
    assert str(refused.value).startswith(message) and "control character" not in str(refused.value)


def test_a_line_nested_past_the_parsers_depth_is_a_value_error_not_a_recursion_error():
    """fix15f's note: the --replay loader still crashed on `[[[[...]]]]` 100,000 deep (RecursionError, which
    no ValueError handler catches); every other reader of outside JSON already refused it in one line."""
    with pytest.raises(ValueError, match="nested too deeply to be an engine event: arrays or objects nested"):
        ev.from_json('{"type":"StepTimed","time":' + "[" * 100_000 + "]" * 100_000 + "}")

"""Newcomer trial 20d: a trace recorded by an app attached to a server (``--connect URL --trace F``)
replayed nothing, a trace without its ModelLoading line replayed "loading model" forever, and the
Engine panel counted running requests where the step it describes counts samples (n > 1)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from nanovllm_core import events as ev
from nanovllm_core.tracing import JsonlTraceWriter
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.replay import ReplayController, load_trace
from tests.conftest import poll_until
from tests.tui_helpers import TRACE, Notes, wait_until

pytestmark = pytest.mark.anyio


def _lines(path: Path = TRACE) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line for line in f if line.strip()]


async def _play_stepwise(trace: Path, tmp_path: Path) -> tuple[NanoVLLMApp, Notes, int]:
    """Replay ``trace`` paused and press n until the recording has ended: (app, its toasts, steps played)."""
    controller = ReplayController(load_trace(trace), start_paused=True)
    app = NanoVLLMApp(controller, tutorial_path=tmp_path / "t.json")
    notes = Notes()
    async with app.run_test(size=(120, 40), message_hook=notes) as pilot:
        await wait_until(pilot, lambda: app.state.ready, 10, "the replay's model facts")
        for _ in range(controller.num_steps + 2):
            before = controller.steps_played
            await pilot.press("n")
            if before < controller.num_steps:
                await wait_until(pilot, lambda: controller.steps_played > before, 10, "the next step")
        await wait_until(pilot, lambda: app.state.unfinished is not None, 10, "the recording's end")
        return app, notes, controller.steps_played


# ---------------------------------------------------------------- 1: traces that start mid-run


async def test_a_trace_recorded_by_an_attached_app_replays_every_step(tiny_server, tmp_path):
    """The recorder of an app attached after the server had run a step writes the server's snapshot
    first (its newest StepPlanned and StepTimed, of a request that has ended): paused, n said "the
    recording has no more steps" before any step played, since no request was known yet."""
    import openai

    from nanovllm_tui.remote import RemoteController

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=tiny_server.api_key, max_retries=0, timeout=60)
    model = tiny_server.controller.engine.model_name
    client.completions.create(model=model, prompt="before the app", max_tokens=2, temperature=0)
    tiny_server.wait_idle()
    path = tmp_path / "conn.jsonl"
    recorder = JsonlTraceWriter(path)
    remote = RemoteController(tiny_server.url, tiny_server.api_key)
    seen: list[ev.Event] = []

    def record(e: ev.Event) -> None:  # the file is buffered until closed: what was recorded, meanwhile
        seen.append(e)
        recorder(e)

    remote.subscribe(record, topk=5, blocks=True)
    remote.start()
    try:
        assert poll_until(lambda: recorder.count >= 2, 10), "the attach snapshot"
        done = client.completions.create(model=model, prompt="after the app", max_tokens=3, temperature=0)
        assert poll_until(lambda: any(isinstance(e, ev.RequestFinished) and e.request_id.startswith(done.id)
                                      for e in seen), 10)
    finally:
        remote.shutdown()
        recorder.close()
    kinds = [json.loads(line)["type"] for line in path.read_text(encoding="utf-8").splitlines()]
    # the case of the trial; since trial 29c the snapshot introduces the request of that step, and its end
    assert kinds[:4] == ["ModelLoading", "RequestAdded", "TokenSampled", "StepPlanned"], kinds[:7]
    app, notes, played = await _play_stepwise(path, tmp_path)
    assert not notes.find("no more steps") or played == app.controller.num_steps
    assert played == app.controller.num_steps >= 2
    assert [r.state for r in app.state.requests.values()] == ["finished", "finished"]


async def test_a_trace_that_starts_inside_a_step_plays_to_its_end(tmp_path):
    """A recording cut at its start inside a step (its first lines a step's TokenSampled and StepTimed)."""
    lines = _lines()
    planned = [i for i, line in enumerate(lines) if '"type":"StepPlanned"' in line]
    start = planned[3] + 1  # just after the fourth step's StepPlanned
    path = tmp_path / "mid.jsonl"
    path.write_text(lines[0] + "".join(lines[start:]), encoding="utf-8")
    app, notes, played = await _play_stepwise(path, tmp_path)
    assert played == len(planned) - 4 and played == app.controller.num_steps
    assert not notes.find("no more steps")[:-2]  # said only once the last step had played


def test_a_connect_trace_across_a_server_restart_loads_and_marks_the_old_requests_lost(tmp_path):
    """The app's recorder writes the ServerRestarted it is told of: loading said "not an engine event"."""
    from nanovllm_tui.remote import ServerRestarted
    from nanovllm_tui.state import EngineState

    lines = _lines()
    planned = [i for i, line in enumerate(lines) if '"type":"StepPlanned"' in line]
    cut = planned[3]
    path = tmp_path / "restart.jsonl"
    path.write_text("".join(lines[:cut]) + ev.to_json(ServerRestarted(url="http://127.0.0.1:1", time=1.0)) + "\n"
                    + lines[0], encoding="utf-8")
    events = load_trace(path)
    assert any(isinstance(e, ServerRestarted) for e in events)
    state = EngineState()
    for e in events:
        state.apply(e)
    assert state.requests and {r.state for r in state.requests.values()} <= {"lost", "finished"}
    assert state.step is None


# ---------------------------------------------------------------- 4: a trace without the model's facts


def test_a_trace_without_its_model_facts_is_refused_naming_the_first_step_line(tmp_path, capsys):
    """``tail -n +2 run.jsonl``: played, the header said "loading model ... (prompts sent now wait in the
    queue)" and the Engine panel LOADING while its steps ran, forever. Every recorder writes the model's
    facts (a ready ModelLoading) before the first step, so it is a corrupt trace: one line, status 2."""
    from nanovllm_tui.options import parse_args

    lines = _lines()
    path = tmp_path / "no_model.jsonl"
    path.write_text("".join(lines[1:]), encoding="utf-8")
    first_step = next(n for n, line in enumerate(lines[1:], 1) if '"type":"StepPlanned"' in line)
    with pytest.raises(ValueError, match=rf"^line {first_step}: step 0 comes before the model's facts"):
        load_trace(path)
    with pytest.raises(SystemExit) as stop:
        parse_args(["--replay", str(path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"line {first_step}: step 0 comes before the model's facts" in err and "record one" in err
    # the facts later than a step are as missing (a ModelLoading moved below it)
    moved = tmp_path / "moved.jsonl"
    moved.write_text("".join(lines[1:first_step + 1]) + lines[0] + "".join(lines[first_step + 1:]), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^line {first_step}: step 0 comes before"):
        load_trace(moved)


def test_a_replay_header_before_its_first_events_claims_no_model_loading_nor_prompts():
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.status_header import StatusHeader

    header = StatusHeader()
    texts = {}
    header.show_content = lambda text: texts.setdefault("line", text.plain)
    header.show(EngineState(), replay=True, loading_s=3.0, width=120)
    assert "reading the recording" in texts["line"]
    assert "loading model" not in texts["line"] and "prompts" not in texts["line"]
    texts.clear()
    header.show(EngineState(), replay=False, loading_s=3.0, width=120)
    assert "loading model" in texts["line"] and "prompts sent now wait in the queue" in texts["line"]


# ---------------------------------------------------------------- 5: requests and samples


def test_the_engine_panel_counts_running_samples_as_the_engine_does_and_names_the_requests(make_tiny_engine):
    """A request with n = 2 runs two samples: the panel said "2 running" beside "3 decode" while the
    step's StepTimed.num_running (and /metrics num_requests_running) said 3."""
    from nanovllm_core import SamplingParams
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text

    engine = make_tiny_engine(num_kv_blocks=64)
    state = EngineState()
    engine.subscribe(state.apply, topk=0)
    engine.add_request("one two three", SamplingParams(max_tokens=6, n=2, ignore_eos=True), request_id="pair")
    engine.add_request("four five", SamplingParams(max_tokens=6, ignore_eos=True), request_id="one")
    engine.add_request("six seven", SamplingParams(max_tokens=6, n=2, ignore_eos=True), request_id="later")
    for _ in range(3):
        engine.step()
    timed = state.timings[-1]
    assert state.queue_counts()[0] == 3 and state.queue_samples()[0] == timed.num_running == 5
    text = phase_text(state).plain
    assert "5 running (3 requests) · 0 waiting" in text and "5 decode" in text, text
    assert "5 run (3 req)" in phase_text(state, width=26).plain
    engine.abort_request("pair")  # between steps: its two samples leave with it
    assert state.queue_samples()[0] == 3 and "3 running (2 requests)" in phase_text(state).plain
    # one sample each: the plain words, as before
    solo = EngineState()
    engine2 = make_tiny_engine(num_kv_blocks=64)
    engine2.subscribe(solo.apply, topk=0)
    engine2.add_request("four five", SamplingParams(max_tokens=6, ignore_eos=True), request_id="one")
    engine2.step()
    assert "1 running · 0 waiting" in phase_text(solo).plain


def test_after_every_step_the_panel_counts_the_samples_the_engine_queues(make_tiny_engine):
    """Trial 37c: an n=2 request whose prompt's first step cached it has its second sample in the engine's
    waiting queue (StepTimed.num_waiting 1, /metrics 1) while the Engine panel said "0 waiting". After
    every step the panel's samples are the engine's own counts, and the words say whose they are."""
    from nanovllm_core import SamplingParams
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text

    engine = make_tiny_engine(num_kv_blocks=64, max_num_seqs=3)
    state = EngineState()
    engine.subscribe(state.apply, topk=0)
    long = " ".join(["one two three four five six seven eight"] * 6)  # full blocks to share: siblings wait
    engine.add_request(long, SamplingParams(max_tokens=4, n=3, ignore_eos=True), request_id="three")
    engine.add_request("four five", SamplingParams(max_tokens=3, ignore_eos=True), request_id="solo")
    seen_of_running = False
    for _ in range(30):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        timed = state.timings[-1]
        running, waiting, of_running = state.queue_samples()
        assert (running, waiting) == (timed.num_running, timed.num_waiting), (timed.step, running, waiting)
        if of_running and not state.queue_counts()[1]:
            seen_of_running = True
            whose = "1 sample of a running request" if of_running == 1 else f"{of_running} samples of running requests"
            assert f"{waiting} waiting ({whose})" in phase_text(state).plain
    assert seen_of_running  # the case the trial met happened here

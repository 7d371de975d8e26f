"""EngineState: how the app reads a request's life and the engine's figures from the event stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanovllm_core import events as ev
from nanovllm_tui.replay import load_trace, split_steps
from nanovllm_tui.state import EngineState

TRACE = Path(__file__).parent / "data" / "tui_trace.jsonl.gz"


@pytest.fixture(scope="module")
def steps():
    return split_steps(load_trace(TRACE))


def fold(prologue, steps, n):
    state = EngineState()
    for e in prologue + [e for group in steps[:n] for e in group]:
        state.apply(e)
    return state


def test_ready_event_gives_the_model_facts(steps):
    state = fold(steps[0], steps[1], 0)
    assert state.ready and state.model_name == "SmolLM2-135M-Instruct"
    assert state.model_info["num_layers"] == 30 and state.model_info["num_kv_blocks"] == 12
    assert state.phase == "idle"  # nothing has run yet


def test_chunked_prefill_progress_follows_the_scheduled_chunks(steps):
    prologue, groups = steps
    after_first = fold(prologue, groups, 1)
    req = after_first.requests["0"]
    assert (req.prompt_len, req.prefilled, req.state) == (10, 2, "running")  # a 2-token chunk of 10
    assert after_first.requests["1"].state == "waiting"
    assert fold(prologue, groups, 2).requests["0"].prefilled == 9


def test_prefix_cache_hit_is_counted_for_the_request(steps):
    state = fold(*steps, 3)
    assert state.requests["1"].num_cached == 8


def test_tokens_stream_into_the_text_and_finish_with_the_engine_figures(steps):
    prologue, groups = steps
    state = fold(prologue, groups, len(groups))
    finished = {e.request_id: e for g in groups for e in g if isinstance(e, ev.RequestFinished)}
    for rid, req in state.requests.items():
        assert req.state == "finished" and req.text == finished[rid].output_text
        assert req.ttft == finished[rid].ttft_s and req.num_output == 6
    assert state.phase == "idle" and not state.active_requests


def test_phase_names_the_newest_batch(steps):
    prologue, groups = steps
    assert fold(prologue, groups, 1).phase == "prefill"
    assert fold(prologue, groups, 3).phase == "prefill+decode"
    assert fold(prologue, groups, 4).phase == "decode"


def test_throughput_is_tokens_over_engine_time(steps):
    prologue, groups = steps
    state = fold(prologue, groups, 2)
    timed = [e for g in groups[:2] for e in g if isinstance(e, ev.StepTimed)]
    prefill, decode = state.throughput()  # each over the steps that did that kind of work
    prefilled = [t for t in timed if t.num_prefill_tokens and not t.num_decode_tokens]
    assert prefill == pytest.approx(sum(t.num_prefill_tokens for t in prefilled) / sum(t.wall_time_s for t in prefilled))
    # step 1 prefilled and decoded one token: its time is shared, so it is in neither rate (trial 13b)
    assert timed[1].num_prefill_tokens and timed[1].num_decode_tokens == 1 and decode == 0


def test_layer_traces_keep_only_the_newest_step(steps):
    prologue, groups = steps
    state = fold(prologue, groups, 2)
    assert sorted(state.xray) == list(range(30)) and {t.step for t in state.xray.values()} == {1}
    assert state.heat is not None and state.heat.attention


def test_a_rejected_prompt_keeps_its_reason():
    state = EngineState()
    state.submitted("req-0", "", 0, 8)
    state.apply(ev.RequestRejected(request_id="req-0", reason="the prompt is empty"))
    assert state.requests["req-0"].state == "rejected" and state.requests["req-0"].error == "the prompt is empty"
    assert not state.requests["req-0"].live


def test_model_load_failure_is_the_failed_phase():
    state = EngineState()
    state.apply(ev.EngineError(step=None, message="model failed to load: model path /x does not exist"))
    assert state.phase == "failed" and state.load_error == "model path /x does not exist"


def shifted(events, seconds):
    import dataclasses

    return [dataclasses.replace(e, time=e.time + seconds) for e in events]


def test_time_held_paused_is_left_out_of_the_live_ttft_and_tpot(steps):
    """The recording again, but held paused for 5 s before step 2, single-stepped, and paused 3 s
    more after it: every live figure stays the recorded one, and each request says how long it waited."""
    prologue, groups = steps
    plain, paused = EngineState(), EngineState()
    for e in prologue + [e for g in groups[:2] for e in g]:
        plain.apply(e)
        paused.apply(e)
    t = groups[2][0].time
    paused.apply(ev.EnginePaused(step=1, time=t))
    for e in shifted(groups[2], 5.0):  # one step, run with n while paused
        paused.apply(e)
    timed = next(e for e in groups[2] if isinstance(e, ev.StepTimed))
    paused.apply(ev.EngineResumed(step=2, time=timed.time + 8.0))  # held 5 s before the step and 3 s after
    for g in groups[2:]:
        for e in g:
            plain.apply(e)
    for e in shifted([e for g in groups[3:] for e in g], 8.0):
        paused.apply(e)
        if isinstance(e, ev.StepTimed):  # compare live figures after every step
            for rid, req in paused.requests.items():
                if req.finished_ttft is None:
                    mid = fold(prologue, groups, e.step + 1).requests[rid]
                    assert req.ttft == pytest.approx(mid.ttft) and req.tpot == pytest.approx(mid.tpot)
    live = [r for r in plain.requests.values() if r.first_token_time and r.first_token_time > t]
    assert live and all(paused.requests[r.request_id].paused_s == pytest.approx(8.0) for r in live)


def test_a_speculative_verification_step_is_the_verify_phase_and_the_dashboard_counts_its_drafts(make_tiny_engine):
    from nanovllm_core.sampling_params import SamplingParams
    from nanovllm_tui.views.dashboard import phase_text

    engine = make_tiny_engine(speculative_model="self:1", num_speculative_tokens=3)
    state, phases, texts = EngineState(), [], []
    state.ready = True  # the controller's ready event, which this bare engine does not send

    def seen(e):
        state.apply(e)
        if isinstance(e, ev.StepPlanned):
            phases.append(state.phase)
            texts.append(phase_text(state, 80).plain)

    engine.subscribe(seen)
    engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    verify = [i for i, p in enumerate(phases) if p == "verify"]
    assert phases[0] == "prefill" and verify, phases
    plan = [e for e in state.plan.scheduled]  # the last step's plan
    assert all(s.num_tokens == 1 + s.num_spec_tokens for s in plan if s.num_spec_tokens)
    assert "1 verifying 3 draft tokens" in texts[verify[0]] and "0 decode" in texts[verify[0]]


def test_a_prompts_last_token_with_drafts_is_prefill_and_verify_not_a_four_token_prefill(make_tiny_engine):
    """Trial 10: a chunk left only the prompt's last token, which ran with 3 drafts (a prefill entry of
    1 + 3 tokens). The phase, the Dashboard, the tutorial's step line and the step's prefill count
    treated all 4 as prompt tokens."""
    from nanovllm_core.sampling_params import SamplingParams
    from nanovllm_tui.views.dashboard import phase_text
    from nanovllm_tui.views.tutorial import TutorialView

    engine = make_tiny_engine(speculative_model="self:1", num_speculative_tokens=3, max_num_batched_tokens=8)
    state, seen = EngineState(), []
    state.ready = True  # the controller's ready event, which this bare engine does not send

    def watch(e):
        state.apply(e)
        if isinstance(e, ev.StepPlanned) and e.step == 1:
            seen.append((state.phase, phase_text(state, 80).plain, TutorialView._what(e.scheduled[0]), e.scheduled[0]))
        if isinstance(e, ev.StepTimed) and e.step == 1:
            seen.append(e)

    engine.subscribe(watch)
    engine.add_request(list(range(5, 14)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    (phase, text, what, entry), timed = seen
    assert (entry.kind, entry.start, entry.num_tokens, entry.num_drafts, entry.seq_len) == ("prefill", 8, 4, 3, 9)
    assert phase == "prefill+verify" and what == "prefill 1 + verify 3"
    assert "1 prefill · 0 decode" in text and "1 verifying 3 draft tokens" in text, text
    assert (timed.num_prefill_tokens, timed.num_decode_tokens) == (1, 3)


def test_the_dashboards_prefill_rate_is_the_one_the_narrator_tells():
    """Issue 29: the Dashboard's prefill rate was over the last 10 steps, decode-only ones included,
    and the Narrator's over a step's tokens of both kinds; they disagreed. Both are prefill tokens
    over the wall time of the steps that prefilled (one step: the Narrator's)."""
    import re

    from nanovllm_core.educational.narrator import Narrator

    events = load_trace(TRACE)
    state, narrator = EngineState(), Narrator()
    checked = 0
    for event in events:
        state.apply(event)
        notes = narrator.feed(event)
        told = [re.search(r"a prefill rate of ([\d,.]+) tokens/s", n.text) for n in notes if n.kind == "prefill"]
        for found in filter(None, told):
            timed = state.timings[-1]
            alone = EngineState()  # the Dashboard's rate over this one step
            alone.apply(timed)
            assert timed.num_prefill_tokens and found.group(1) == f"{alone.rate('prefill')[0]:,.0f}"
            checked += 1
    assert checked
    prefill_steps = [t for t in state.timings if t.num_prefill_tokens and not t.num_decode_tokens][-10:]
    rate, steps = state.rate("prefill")
    assert steps == len(prefill_steps)
    assert rate == pytest.approx(sum(t.num_prefill_tokens for t in prefill_steps)
                                 / sum(t.wall_time_s for t in prefill_steps))

    one = EngineState()  # a prompt prefilled in one step, then 9 decode steps: the rate is that step's
    step = dict(num_running=1, num_waiting=0, kv_bytes_used=0, kv_bytes_total=1)
    one.apply(ev.StepTimed(step=0, wall_time_s=0.1, num_tokens=100, num_prefill_tokens=100, num_decode_tokens=0,
                           prefill_tokens_per_s=1000.0, decode_tokens_per_s=0.0, **step))
    for i in range(1, 10):
        one.apply(ev.StepTimed(step=i, wall_time_s=0.05, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
                               prefill_tokens_per_s=0.0, decode_tokens_per_s=20.0, **step))
    assert one.rate("prefill") == (pytest.approx(1000.0), 1)


def test_the_top_k_caption_names_every_processor_and_a_special_token_is_named():
    state = EngineState()
    state.apply(ev.RequestAdded(request_id="r", prompt="Hi", prompt_token_ids=(1,), prompt_pieces=("Hi",), priority=0,
                                max_tokens=4, sampling=(("temperature", 0.7), ("top_k", 20), ("min_p", 0.1))))
    top = (ev.TopToken(2, "<|im_end|>", 0.8), ev.TopToken(28, ",", 0.2))
    state.apply(ev.TokenSampled(step=1, request_id="r", seq_id=0, index=0, token_id=2, text="", position=1,
                                num_output_tokens=1, top=top, greedy=False, temperature=0.7, special="<|im_end|>"))
    req = state.requests["r"]
    assert req.top_caption == "probabilities after temperature 0.7, min-p 0.1 and top-k 20, renormalised"
    assert req.last_token == "<|im_end|>"


def test_a_request_refused_before_it_was_added_shows_no_made_up_priority():
    """Trial 9: a replay showed a rejected request's priority as 0 (the event carries none; it was 5)."""
    from nanovllm_tui.widgets.request_table import row_cells

    state = EngineState()
    state.apply(ev.RequestRejected(request_id="req-1", reason="too long"))
    assert state.requests["req-1"].priority is None and row_cells(state.requests["req-1"])[2].plain == "-"
    state.submitted("req-2", "Hi", 5, 8)  # sent from this app: what it sent is known
    state.apply(ev.RequestRejected(request_id="req-2", reason="too long"))
    assert row_cells(state.requests["req-2"])[2].plain == "5"


def test_the_block_map_summary_says_prefix_caching_is_off_rather_than_a_0_percent_hit_rate(make_tiny_engine):
    """Trial 10: with --no-prefix-caching the Block Map read "prefix-cache hit rate 0%"."""
    from nanovllm_tui.views.block_map import summary_text

    engine = make_tiny_engine(enable_prefix_caching=False, num_kv_blocks=8)
    blocks = engine.blocks_event(0)
    assert engine.model_info()["prefix_caching"] is False  # what the app's state.model_info holds
    off = summary_text(blocks, engine.model_info()["prefix_caching"]).plain
    assert "prefix caching off" in off and "hit rate" not in off
    assert "prefix-cache hit rate 0%" in summary_text(blocks, True).plain



def test_the_cached_column_is_a_finishs_first_admission_figure_not_its_readmissions():
    """Trial 14c #2: a replay that missed the plans still shows what the finish reports; trial 24d #3:
    that is the first admission's prompt tokens (vLLM's num_cached_tokens), not a readmission's."""
    from dataclasses import replace

    from tests.test_narrator import added, finished

    state = EngineState()
    state.apply(added())
    state.apply(replace(finished(), num_preemptions=1, num_cached_prompt_tokens=8, num_cached_tokens_readmitted=16))
    assert state.requests["0"].num_cached == 8


def test_a_conversation_sent_elsewhere_shows_its_messages_not_its_raw_chat_template():
    """Trial 27b: a replay (or an attached server's chat client) showed a chat request's prompt as its
    template's rendering, ``<|im_start|>user...``, where the live app shows the message. The
    conversation's messages are shown, one ``role: text`` a line, and what answers is the Assistant."""
    from nanovllm_tui.views.dashboard import exchange
    state = EngineState()
    pieces = ("<|im_start|>", "system", "\n", "Be brief", "<|im_end|>", "<|im_start|>", "user", "\n", "Hi", "<|im_end|>")
    state.apply(ev.RequestAdded(request_id="r", prompt=None, prompt_token_ids=tuple(range(len(pieces))),
                                prompt_pieces=pieces, priority=0, max_tokens=4,
                                chat=(("system", "Be brief"), ("user", "Hi \x1b[31m"))))
    shown = exchange(state.requests["r"]).plain
    assert shown.startswith("Chat (2 messages)\nsystem: Be brief\nuser: Hi ␛[31m\nAssistant\n"), shown
    assert "<|im_start|>" not in shown
    # a text prompt from elsewhere keeps the plain labels, with its control characters made visible too
    state.apply(ev.RequestAdded(request_id="t", prompt="a\x1bb", prompt_token_ids=(1, 2), prompt_pieces=("a", "b"),
                                priority=0, max_tokens=4))
    assert exchange(state.requests["t"]).plain == "Prompt\na␛b\nOutput\n"


def test_a_server_out_of_reach_is_the_disconnected_phase_not_the_paused_one_it_last_told():
    """Trial 29c: after the server died, the header said "disconnected" and the Engine panel still
    "PAUSED": the server may have resumed meanwhile. Every panel says what is known: the lost connection."""
    from nanovllm_tui.views.dashboard import phase_text
    from nanovllm_tui.widgets.throughput import not_running

    state = EngineState()
    state.ready, state.paused = True, True
    assert state.phase == "paused"
    for lost in ("disconnected", "key refused", "stopped"):
        state.engine_state = lost
        assert state.phase == "disconnected" and not state.busy
        assert phase_text(state).plain.startswith("DISCONNECTED"), phase_text(state).plain
        assert not_running(state) == "disconnected"
    state.engine_state = "paused"  # reconnected: what the server says again
    assert state.phase == "paused"


def test_a_prompt_sent_to_an_idle_engine_is_not_shown_under_the_finished_steps_phase():
    """Trial 31a: for a moment after a prompt was sent to an idle engine the Engine panel read "DECODE · step 93
    ... 0 prefill · 1 decode · 0 running · 1 waiting": the newest plan's step had ended with its request."""
    from tests.test_narrator import added, entry, planned, timed

    state = EngineState()
    state.ready, state.engine_state = True, "running"
    state.apply(added("0"))
    state.apply(planned(5, [entry("0", kind="decode", num=1, start=3, total_len=4)]))
    assert state.phase == "decode"
    state.apply(timed(5))
    assert state.phase == "decode"  # between two steps of a request still running: its kind
    state.requests["0"].state = "finished"
    state.apply(added("1"))  # a new prompt, waiting for its first step
    assert state.phase == "idle"
    state.apply(planned(6, [entry("1", num=3, start=0, total_len=3)]))
    assert state.phase == "prefill"


def test_the_kv_title_names_every_abort_between_steps():
    """Trial 36c: aborted while paused, the KV panel showed the pool after the abort under "after step 195"."""
    import dataclasses
    from types import SimpleNamespace

    from nanovllm_core import events as ev
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.kv_bar import KVMemoryBar
    from tests.test_narrator import added, entry, finished, planned, timed

    state = EngineState()
    state.apply(added("0"))
    state.apply(planned(195, [entry("0")]))
    state.apply(timed(195, blocks=3, total=8))
    wide = SimpleNamespace(size=SimpleNamespace(width=200))
    assert KVMemoryBar.title_for(wide, state) == "KV cache memory · after step 195"
    state.apply(dataclasses.replace(finished("0", step=195), finish_reason="abort", kv_blocks_used=0,
                                    kv_blocks_cached=2))
    assert state.kv.num_blocks_used == 0
    assert KVMemoryBar.title_for(wide, state) == "KV cache memory · after step 195 and 0's abort"
    narrow = SimpleNamespace(size=SimpleNamespace(width=36))
    assert KVMemoryBar.title_for(narrow, state) == "KV · after step 195 and an abort"
    # trial 43c: an abort that changed no figure (a preempted request holding no block) is counted too: the
    # title read "2 aborts" beside 3 rows "finished (abort)"
    state.apply(added("1"))
    state.apply(dataclasses.replace(finished("1", step=195), finish_reason="abort", kv_blocks_used=0,
                                    kv_blocks_cached=2))
    assert KVMemoryBar.title_for(wide, state) == "KV cache memory · after step 195 and 2 aborts"
    state.apply(planned(196, [entry("0")]))
    state.apply(timed(196, blocks=1, total=8))
    assert KVMemoryBar.title_for(wide, state) == "KV cache memory · after step 196"


def test_the_engine_panel_says_its_queues_are_after_an_abort_between_steps():
    """Trial 36c: paused, an abort left the Engine panel saying "last step 195: 2 decode" beside "1 running"
    with nothing to say the queue line was after the abort and the batch line before it."""
    import dataclasses

    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.dashboard import phase_text
    from tests.test_narrator import added, entry, finished, planned, timed

    state = EngineState()
    state.ready, state.engine_state = True, "running"
    for rid in ("0", "1"):
        state.apply(added(rid))
    state.apply(planned(195, [entry("0", kind="decode", num=1, start=3, total_len=4),
                              entry("1", kind="decode", num=1, start=3, total_len=4)]))
    state.apply(timed(195, blocks=3, total=8))
    for rid in ("0", "1"):
        state.requests[rid].state = "running"
    before = phase_text(state).plain
    assert "2 running" in before and "abort" not in before
    state.apply(dataclasses.replace(finished("0", step=195), finish_reason="abort", kv_blocks_used=1))
    text = phase_text(state).plain
    assert "0 prefill · 2 decode" in text  # the step's batch, as it ran
    assert "after 0's abort: 1 running · 0 waiting" in text
    assert "now: 1 run" in phase_text(state, width=24).plain
    state.requests["1"].state = "preempted"  # trial 40c: "now: 1 run · 0 wait · 1" lost its "pre" at 120x40
    state.apply(added("2"))
    state.requests["2"].state = "running"
    for width in (22, 24, 26, 30, 60):
        line = phase_text(state, width=width).plain.splitlines()[-1]
        assert line.endswith(("1 pre", "1 preempted")) and len(line) <= width, (width, line)
    state.requests["1"].state = "running"
    del state.requests["2"]
    state.apply(dataclasses.replace(finished("1", step=195), finish_reason="abort", kv_blocks_used=0))
    assert "after 2 aborts: 0 running" in phase_text(state).plain
    state.apply(planned(196, []))
    state.apply(timed(196, blocks=0, total=8))
    assert "abort" not in phase_text(state).plain  # a new step: its batch and the queues agree again


def test_a_request_aborted_while_preempted_shows_its_prompt_prefilled():
    """Trial 42c: aborted while preempted (its KV dropped), the finished row read prefill "0/35" beside its TTFT and
    14 decoded tokens; the prompt had run whole once."""
    import dataclasses

    from nanovllm_tui.state import EngineState
    from tests.test_narrator import added, entry, finished, planned, queued, timed

    state = EngineState()
    state.apply(added("0"))
    state.apply(planned(0, [entry("0")]))
    state.apply(timed(0))
    assert state.requests["0"].prefilled == 3
    preempted = dataclasses.replace(queued("0", num_tokens=5, preemptions=1), status="preempted")
    state.apply(planned(1, [], waiting=[preempted], running=[], preempted=[preempted], admitted=()))
    assert state.requests["0"].state == "preempted" and state.requests["0"].prefilled == 0  # its KV is gone now
    state.apply(dataclasses.replace(finished("0", n_out=2, step=1), finish_reason="abort"))
    assert state.requests["0"].state == "finished" and state.requests["0"].prefilled == 3
    state.apply(added("1"))  # aborted before its first token: the prefill it reached stays as it was
    state.apply(dataclasses.replace(finished("1", n_out=0, step=1), finish_reason="abort"))
    assert state.requests["1"].prefilled == 0

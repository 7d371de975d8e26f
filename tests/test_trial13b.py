"""Trial 13b (issue 29): an inference expert's review of the teaching text."""

from __future__ import annotations

import io
import re
from dataclasses import replace

import pytest

from rich.console import Console

from nanovllm_core import events as ev
from nanovllm_core.educational.dashboard_view import DashboardView
from tests.test_narrator import INFO, added, entry, fresh, planned, sampled, timed


def mixed_timed(step=1, wall=0.0756, prefill=3, decode=1):
    return replace(timed(step, wall=wall, tokens=prefill + decode), num_prefill_tokens=prefill,
                   num_decode_tokens=decode, prefill_tokens_per_s=prefill / wall, decode_tokens_per_s=decode / wall)


def mixed_prefill_entry(traced=False):
    """A prompt's 3 tokens prefilled in a step where request 1 also decodes 1 token."""
    n = fresh()
    n.feed(added("1", max_tokens=4))
    n.feed(planned(0, [entry("1")]))
    n.feed(sampled(0, rid="1"))
    n.feed(timed(0))
    n.feed(added("0"))
    n.feed(planned(1, [entry("0"), entry("1", kind="decode", num=1, start=3, total_len=4)]))
    n.feed(sampled(1, rid="0"))
    n.feed(sampled(1, rid="1", n_out=2))
    step = mixed_timed()
    return next(c for c in n.feed(replace(step, traced=traced)) if c.kind == "prefill" and c.request_id == "0")


def test_a_mixed_step_tells_the_rate_of_all_its_tokens_and_no_prefill_rate():
    """Seen: "The step took 75.6 ms for its 4 tokens, 3 of them prefill: a prefill rate of 40 tokens/s":
    3 prefill tokens over a step that also decoded is no prefill rate."""
    flat = " ".join(mixed_prefill_entry().text.split())
    assert "a prefill rate of" not in flat and "40 tokens/s" not in flat, flat
    assert ("The step took 75.6 ms for its 4 tokens, 3 of them prefill and 1 decoded or verified: 53 tokens/s for all "
            "of them; a step that also decodes has no prefill rate of its own") in flat, flat
    traced = " ".join(mixed_prefill_entry(traced=True).text.split())
    assert "53 tokens/s for all of them with the X-Ray's capture" in traced and "prefill rate of 40" not in traced


def test_a_pure_prefill_step_keeps_its_prefill_rate():
    n = fresh()
    n.feed(added())
    n.feed(planned(0, [entry()]))
    n.feed(sampled(0))
    pre = next(c for c in n.feed(timed(0, wall=0.05)) if c.kind == "prefill")
    assert "The step took 50.0 ms for its 3 tokens: a prefill rate of 60 tokens/s." in " ".join(pre.text.split())


def render(*events) -> str:
    buf = io.StringIO()
    view = DashboardView(Console(file=buf, width=140, highlight=False), INFO)
    for e in events:
        view(e)
    view.stop()
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", buf.getvalue()).split())


def test_the_cli_dashboard_tells_no_prefill_or_decode_rate_for_a_mixed_step():
    board = render(mixed_timed())
    assert "Prefill 40" not in board and "Decode 13" not in board, board
    assert "All tokens 52.9 tok/s (last step)" in board, board  # 4 / 75.6 ms
    assert "(a mixed step: 3 prefill + 1 decode or draft tokens" in board, board
    pure = render(timed(0, wall=0.05))
    assert "Prefill 60.0 tok/s (last step)" in pure and "All tokens" not in pure, pure
    # trial 26a: the kind the step ran none of has no rate ("Decode 0.0 tok/s" read as measured)
    assert "Decode - (the last step had no decode tokens)" in pure and "Decode 0.0" not in pure, pure


def test_the_app_rates_leave_out_mixed_steps_and_the_border_says_so():
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.throughput import mixed_caption

    state = EngineState()
    state.apply(timed(0, wall=0.1, tokens=10))  # pure prefill: 100 tok/s
    state.apply(mixed_timed(1, wall=0.1, prefill=3, decode=1))
    assert state.rate("prefill") == (100.0, 1)  # not (10 + 3) / 0.2
    assert state.rate("decode") == (0.0, 0)
    assert mixed_caption(1, 80) == "1 mixed prefill+decode step not in rates"
    assert mixed_caption(0, 80) == ""


def test_the_docs_say_what_the_narrator_tells_over_a_traced_step():
    """docs/app.md said the Narrator "tells no bandwidth or prefill rate" over a traced step, and
    docs/teaching.md "tells no rate over it"; it gives a rate, labelled as including the capture."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = mixed_prefill_entry(traced=True).text
    assert "tokens/s" in text and "X-Ray's capture" in text  # a rate is told, and labelled
    app = " ".join((root / "docs" / "app.md").read_text().split())
    teaching = " ".join((root / "docs" / "teaching.md").read_text().split())
    assert "tells no bandwidth or prefill rate over it" not in app
    assert "labelled as including the capture" in app
    assert "tells no rate over it" not in teaching and "labels the one rate it gives" in teaching


def test_a_waiting_requests_preemption_says_vllm_v1_would_let_it_wait():
    """The scheduler said it "follows vLLM's V1 scheduler", but V1 never preempts for a waiting request
    (its waiting loop stops at `if new_blocks is None: break`); that was V0's _schedule_priority_preemption.
    The entry, the scheduler's docstring, docs/engine.md's migration advice and the tutorial say so."""
    from pathlib import Path

    from nanovllm_core.educational.tutorial import chapter
    from nanovllm_core.engine import scheduler
    from tests.test_narrator import queued

    chunk = entry("1", num=3, prompt_len=37, total_len=37, priority=5)
    waiting = ev.Shortfall(request_id="1", seq_id=1, index=0, blocks_needed=3, blocks_free=2, waiting=True)
    plan = replace(planned(14, [chunk], preempted=[queued("0", num_tokens=20, preemptions=1)], waiting=[queued("0")],
                           admitted=("1",)), shortfalls=(waiting,))
    for p in (plan, replace(plan, shortfalls=())):  # with its shortfall, and a recording made before them
        pre = next(c for c in fresh().feed(p) if c.kind == "preemption")
        assert "vLLM V0 did this too; vLLM V1 preempts only for a running request and lets a waiting one wait" \
            in pre.text, pre.text
    doc = " ".join(scheduler.__doc__.split())
    assert "That rule is not vLLM V1's" in doc and "_schedule_priority_preemption" in doc
    engine = " ".join((Path(__file__).resolve().parent.parent / "docs" / "engine.md").read_text().split())
    assert "To keep the same order under vLLM, pass" not in engine
    assert "vLLM V1 never preempts for a waiting request" in engine
    text = " ".join(chapter("chunked_prefill").text.split())
    assert "as vLLM V0 did; vLLM V1 does not" in text


def test_chapter_13_says_engines_refuse_an_uneven_split_not_that_a_kv_head_is_cut():
    """Seen: "No engine can use an N ...: ... which would each need half a KV head" and "a KV head cut
    between ranks, in any engine". A KV head is never halved: the query heads would split unevenly and a
    KV head would be needed on two ranks; vLLM and this engine refuse it by their divisibility checks."""
    from nanovllm_core.educational.tutorial import chapter

    c = chapter("tensor_parallel")
    text = " ".join(c.text.split()) + " " + " ".join(c.quiz.explanation.split())
    for wrong in ("No engine can", "half a KV head", "cut between ranks", "in any engine"):
        assert wrong not in text, wrong
    assert "vLLM and this engine both refuse (their divisibility checks)" in text
    assert "split its query heads unevenly (5 and 4)" in text and "needed whole on both ranks" in text
    assert "vLLM and this engine both refuse such an N" in text


def test_the_cli_dashboard_shows_preemptions_and_the_recompute_beside_the_prompt_bar():
    """Seen: "Prefill 11/11 prompt tokens" and no preemption anywhere while --show-memory-stats said
    "preemptions: 1". The dashboard shows each request's preemptions (and tokens computed again) and a total,
    and says the prompt bar does not count the recompute."""
    from tests.test_narrator import queued

    steps = [added("0"), added("1", ids=(1, 2, 3), pieces=("a", "b", "c")),
             planned(0, [entry("0"), entry("1")]), timed(0, tokens=6),
             planned(1, [entry("0", kind="decode", num=1, start=3, total_len=4),
                         entry("1", kind="decode", num=1, start=3, total_len=4)]), timed(1, tokens=2),
             # request 1 gives back its blocks (5 tokens: 3 prompt + 2 generated, 4 computed)
             planned(2, [entry("0", kind="decode", num=1, start=4, total_len=5)],
                     preempted=[queued("1", num_tokens=5, preemptions=1)], waiting=[queued("1")], admitted=()),
             timed(2, tokens=1),
             planned(3, [entry("1", num=5, start=0, prompt_len=3, total_len=5)]), timed(3, tokens=5)]
    board = render(*steps)
    assert "6/6 prompt tokens; 1 preemption, 4 tokens recomputed (not in the bar)" in board, board
    assert "preempted" in board and "1 (4 again)" in board, board
    quiet = render(*steps[:4])
    assert "recomputed" not in quiet and "preemption," not in quiet


def test_the_throughput_border_keeps_the_mixed_step_note_beside_the_keys_wait():
    """Trial 22a: with the keys' wait noted, the border showed only "keys 194 ms" and dropped the
    mixed-step note docs/app.md promises (the notes did not fit together in their longest wordings,
    and the first note was kept alone)."""
    from nanovllm_tui.widgets.throughput import border_captions, mixed_caption, traced_caption, yielded_caption

    for width in range(20, 120):
        text = border_captions(0.194, 1, 2, width)
        assert len(text) <= width, (width, text)
        assert mixed_caption(2, width) in text or "mixed" in text, (width, text)  # never the one dropped
    assert border_captions(0.194, 0, 2, 36) == "keys 194 ms · mixed not in rates"
    assert border_captions(0.194, 0, 2, 29) == mixed_caption(2, 29)  # no room for both: the keys' wait goes
    wide = border_captions(0.194, 1, 2, 200)
    assert wide == " · ".join([yielded_caption(0.194, 200), traced_caption(1, 200), mixed_caption(2, 200)])
    assert border_captions(0.0, 0, 0, 80) == ""


def test_the_throughput_border_keeps_the_xray_note_beside_the_mixed_step_note():
    """Trial 33a: at 120 columns (a border of about 26 cells) a traced step's capture was in the decode
    rate (2.4 tok/s) and the border said only "mixed not in rates": the X-Ray's note was dropped."""
    from nanovllm_tui.widgets.throughput import border_captions

    assert border_captions(0.0, 1, 2, 26) == "rates: X-Ray in, mixed out"
    for width in range(19, 120):
        for keys in (0.0, 0.194):
            text = border_captions(keys, 1, 2, width)
            assert len(text) <= width and "X-Ray" in text and "mixed" in text, (width, keys, text)


@pytest.mark.anyio
async def test_a_kind_no_kept_step_did_reads_as_not_seen_not_as_a_measured_zero():
    """Trial 29c: an app attached to a server while its request decoded showed "prefill 0 tok/s", a rate
    never measured (the server had prefilled that request before the app saw any step)."""
    import dataclasses

    from textual.app import App

    from nanovllm_tui.state import EngineState
    from nanovllm_tui.widgets.throughput import ThroughputPanel
    from tests.test_narrator import added, entry, planned

    state = EngineState()
    state.ready, state.engine_state = True, "running"
    state.apply(added("0"))
    decode = ev.StepTimed(step=5, wall_time_s=0.02, num_tokens=1, num_prefill_tokens=0, num_decode_tokens=1,
                          prefill_tokens_per_s=0.0, decode_tokens_per_s=50.0, kv_bytes_used=0, kv_bytes_total=0,
                          num_running=1, num_waiting=0)
    for step in (5, 6):
        state.apply(planned(step, [entry("0", kind="decode", num=1, start=40 + step, total_len=41 + step)]))
        state.apply(dataclasses.replace(decode, step=step))
    assert state.busy and state.rate("prefill") == (0.0, 0)

    class Board(App):
        def compose(self):
            yield ThroughputPanel()

    for width in (60, 24, 14):
        app = Board()
        async with app.run_test(size=(width, 10)) as pilot:
            panel = app.query_one(ThroughputPanel)
            panel.show(state)
            await pilot.pause()
            prefill, decoded = (str(panel.query_one(f"#{k}-rate").render()) for k in ("prefill", "decode"))
            assert "tok/s" not in prefill and "0" not in prefill and "-" in prefill, (width, prefill)
            assert "50" in decoded, (width, decoded)
    wide = Board()
    async with wide.run_test(size=(60, 10)) as pilot:
        wide.query_one(ThroughputPanel).show(state)
        await pilot.pause()
        assert "- (none in the last 2 steps)" in str(wide.query_one("#prefill-rate").render())
    # idle (or paused) after them: the headline says so, and beside the sparkline, where a kind's measured
    # rate would be, that none of the kept steps did it (trial 33a: a blank line under "prefill idle")
    state.engine_state = "idle"
    assert not state.busy
    for width, said in ((60, "none in the last 2 steps"), (24, "none in 2 steps")):
        idle = Board()
        async with idle.run_test(size=(width, 10)) as pilot:
            idle.query_one(ThroughputPanel).show(state)
            await pilot.pause()
            spark = {k: str(idle.query_one(f"#{k}-spark").render()) for k in ("prefill", "decode")}
            assert said in spark["prefill"] and "tok/s" not in spark["prefill"], (width, spark)
            assert "50" in spark["decode"], (width, spark)
            assert "idle" in str(idle.query_one("#prefill-rate").render())

"""Newcomer trial 18a: the paused Block Map kept an aborted request's blocks, its block table was cut
at 120x40 with no sign of more, and a 15/16 block was drawn with the "full" glyph."""

from __future__ import annotations

import pytest

from nanovllm_core import SamplingParams
from nanovllm_core import events as ev

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- 1: blocks released outside a step


def test_an_abort_or_a_failure_between_steps_sends_the_pool_to_a_watcher_of_blocks(make_tiny_engine):
    """The pool changes outside a step's end (an abort, every request failed): a subscriber that
    asked for block snapshots gets one after the release, and the last one shows it."""
    engine = make_tiny_engine(num_kv_blocks=64)
    seen: list[ev.Event] = []
    engine.subscribe(seen.append, topk=0, blocks=True)
    for rid in ("a", "b"):  # greedy past EOS: both still run after two steps whatever the random weights say
        engine.add_request("one two three four five six seven",
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), request_id=rid)
    finished = [o for _ in range(2) for o in engine.step() if o.finished]
    assert not finished, [(o.request_id, o.outputs[0].finish_reason) for o in finished]
    assert {t.request_id for t in engine.blocks_event(engine.step_index).tables} == {"a", "b"}
    seen.clear()
    engine.abort_request("a")
    kinds = [type(e).__name__ for e in seen]
    assert kinds[-1] == "BlocksChanged" and "RequestFinished" in kinds, kinds
    assert kinds.index("RequestFinished") < kinds.index("BlocksChanged"), kinds  # the narrator reads the pool before
    pool = seen[-1]
    assert {t.request_id for t in pool.tables} == {"b"}
    assert pool.states.count("u") == engine.block_manager.num_used_blocks
    seen.clear()
    engine.fail_running("test failure")
    assert isinstance(seen[-1], ev.BlocksChanged) and not seen[-1].tables and "u" not in seen[-1].states, seen[-1:]


def test_nothing_more_is_computed_for_an_abort_when_no_one_watches_the_pool(make_tiny_engine):
    engine = make_tiny_engine(num_kv_blocks=64)
    seen: list[ev.Event] = []
    engine.subscribe(seen.append, topk=0, blocks=False)
    engine.add_request("one two three", SamplingParams(max_tokens=50), request_id="a")
    engine.step()
    seen.clear()
    engine.abort_request("a")
    assert not any(isinstance(e, ev.BlocksChanged) for e in seen), seen


async def test_the_paused_block_map_redraws_from_an_abort(tiny_llama_dir, tmp_path):
    """Trial 18a: paused on the Block Map, ``a`` released the blocks (header, toast, Dashboard) but the map
    kept the aborted request's blocks and legend entry until the tab was left and shown again."""
    from tests.tui_helpers import send_prompt, tiny_app, wait_until

    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=40)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await send_prompt(pilot, "Write a very long story about a dragon")
        await send_prompt(pilot, "Explain the history of Rome")
        await wait_until(pilot, lambda: len(app.state.requests) == 2, 20, "both requests")
        await pilot.press("escape", "5")
        app.controller.step(2)
        await wait_until(pilot, lambda: len(app.state.timings) == 2 and app.state.blocks is not None
                         and len(app.state.blocks.tables) == 2, 30,
                         lambda: f"two steps' pool ({len(app.state.timings)} steps, {app.state.blocks})")
        first, second = app.state.request_ids()[:2]
        app.select(first)
        await pilot.pause(0.1)
        legend = app.query_one("#legend")
        assert first in str(legend.render()), str(legend.render())
        await pilot.press("a")
        await wait_until(pilot, lambda: app.state.requests[first].finish_reason == "abort", 20, "the abort")
        await wait_until(pilot, lambda: app.state.blocks is not None
                         and {t.request_id for t in app.state.blocks.tables} == {second}, 5,
                         "the pool after the abort")
        await pilot.pause(0.3)
        assert first not in str(legend.render()) and second in str(legend.render()), str(legend.render())
        summary = str(app.query_one("#blocks-summary").render())
        used = app.state.blocks.states.count("u")
        assert f"{used} used" in summary and "old" not in summary, summary


# ---------------------------------------------------------------- 3: "full" only when every slot is


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32, 256])
def test_a_block_is_drawn_full_only_when_every_slot_holds_kv(block_size):
    """Trial 18a: a block with 15 of 16 slots was drawn ``██``, the legend's "full"."""
    from nanovllm_tui.widgets.block_grid import LEVELS, fill_glyph

    assert fill_glyph(block_size, block_size) == "█"
    glyphs = [fill_glyph(n, block_size) for n in range(1, block_size)]
    assert "█" not in glyphs, glyphs
    assert all(LEVELS.index(a) <= LEVELS.index(b) for a, b in zip(glyphs, glyphs[1:])), glyphs  # grows with the fill
    assert fill_glyph(1, block_size) != " "  # any KV shows


def test_the_trials_blocks_keep_their_glyphs_but_the_15_of_16_one():
    from nanovllm_tui.widgets.block_grid import fill_glyph

    glyphs = (fill_glyph(6, 16), fill_glyph(1, 16), fill_glyph(14, 16), fill_glyph(15, 16))
    assert glyphs == ("▃", "▁", "▇", "▇")


def test_the_grid_draws_a_15_of_16_block_part_filled(make_tiny_engine):
    from nanovllm_tui.widgets.block_grid import BlockGrid, block_cells

    engine = make_tiny_engine(num_kv_blocks=8)
    engine.add_request(list(range(5, 36)), SamplingParams(max_tokens=4), request_id="r")  # 31 tokens: 16 + 15
    engine.step()
    blocks = engine.blocks_event(engine.step_index)
    grid = BlockGrid()
    grid.owner_colors = {}
    drawn = {c.filled: grid.glyphs(c)[0] for c in block_cells(blocks, None) if c.state == "u"}
    assert drawn[16] == "██" and drawn[15] != "██" and drawn[15] == "▇▇", drawn


@pytest.mark.parametrize("width", [1, 10, 40])
def test_a_bar_is_drawn_to_its_end_only_at_one(width):
    """The kind of trial 18a's 15/16 block: ``bar`` rounded 0.999 (511/512 prefilled) up to a full bar."""
    from nanovllm_tui.widgets.format import BAR_FULL, bar

    assert bar(1.0, width).plain == BAR_FULL * width
    for fraction in (0.999, 511 / 512, 1 - 1e-9, 15 / 16):
        assert bar(fraction, width).plain != BAR_FULL * width, (fraction, bar(fraction, width).plain)
        assert bar(fraction, width).cell_len == width
    assert bar(0.5, 0).plain == ""


# ---------------------------------------------------------------- 2: the block table says what it hides


def trial_pool(num_blocks: int = 22, computed: int = 21 * 16 + 15) -> ev.BlocksChanged:
    """req-12 as in trial 18a: 22 blocks #56, #58 ... #98, the last holding 15 of 16 slots."""
    table = tuple(56 + 2 * i for i in range(num_blocks))
    states = "".join("u" if b in table else "f" for b in range(512))
    return ev.BlocksChanged(step=511, block_size=16, bytes_per_block=737280, states=states,
                            ref_counts=tuple(1 if b in table else 0 for b in range(512)),
                            tables=(ev.SeqBlocks(request_id="req-12", seq_id=0, index=0, block_table=table,
                                                 num_tokens=computed + 1, num_computed_tokens=computed),),
                            prefix_cache_hit_rate=0.3)


@pytest.mark.parametrize("width,height", [(114, 3), (74, 3), (56, 3), (154, 3), (114, 8)])
def test_the_block_table_keeps_its_last_entry_and_says_how_many_it_hides(width, height):
    """Trial 18a: at 120x40 the panel ended at "20→#96" with no sign of "21→#98 15/16" or of more."""
    from rich.console import Console

    from nanovllm_tui.views.block_map import block_table_text

    console = Console(width=200)
    text = block_table_text(trial_pool(), "req-12", {}, width, height, console)
    lines = text.wrap(console, width)
    assert len(lines) <= height, [line.plain for line in lines]
    plain = text.plain
    assert "21→#98 15/16" in plain and "0→#56 16/16" in plain and "unfilled" in plain, plain
    assert ("allocated but unfilled" in plain) == (width >= 114), plain  # the short wording only where needed
    shown = sum(f"{i}→#{56 + 2 * i} " in plain for i in range(22))
    if shown < 22:
        assert f"… {22 - shown} more (" in plain, plain
    else:
        assert "more (" not in plain


def test_a_block_table_that_fits_is_shown_whole():
    from rich.console import Console

    from nanovllm_tui.views.block_map import block_table_text

    whole = block_table_text(trial_pool(3, 40), "req-12", {}).plain
    assert block_table_text(trial_pool(3, 40), "req-12", {}, 114, 3, Console()).plain == whole
    assert "more" not in whole and "2→#60 8/16" in whole


async def test_at_120x40_the_block_map_panel_shows_the_last_block_of_a_long_table(tiny_llama_dir, tmp_path):
    from tests.tui_helpers import tiny_app, wait_until

    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.press("escape", "5")
        app.state.blocks = trial_pool()
        app.select("req-12")
        app.view().update_view(app.state, "req-12")
        await pilot.pause(0.2)
        panel = app.query_one("#block-table")

        def rows() -> list[str]:
            return ["".join(s.text for s in panel.render_line(y)) for y in range(panel.size.height)]

        assert any("21→#98 15/16" in row for row in rows()) and any(" more (" in row for row in rows()), rows()
        await pilot.resize_terminal(80, 24)  # paused: no frame of events redraws it, the resize does
        await wait_until(pilot, lambda: panel.content_region.width < 100
                         and any("21→#98 15/16" in row for row in rows()) and any("unfilled" in row for row in rows()),
                         5, lambda: f"the table refitted: {rows()}")


def test_views_of_the_pool_say_they_are_after_an_abort_between_steps(make_tiny_engine):
    """Trial 36c's kind: aborted between steps (paused), the Block Map read "after step 1" and the Engine
    panel's queues counted one running beside the step's two decodes, neither saying the abort came after the
    step. Both name it, and a new step's figures drop it."""
    from nanovllm_tui.state import EngineState
    from nanovllm_tui.views.block_map import summary_text
    from nanovllm_tui.views.dashboard import phase_text

    engine = make_tiny_engine(num_kv_blocks=64)
    state = EngineState()
    engine.subscribe(state.apply, topk=0, blocks=True)
    for rid in ("a", "b"):
        engine.add_request("one two three four five six seven",
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), request_id=rid)
    for _ in range(2):
        engine.step()
    assert summary_text(state.blocks, True, state).plain.endswith("after step 1")
    assert "2 running" in phase_text(state).plain
    engine.abort_request("a")
    assert summary_text(state.blocks, True, state).plain.endswith("after step 1 and a's abort")
    assert "after a's abort: 1 running" in phase_text(state).plain
    assert "2 decode" in phase_text(state).plain  # the step's batch, as it ran
    engine.step()
    assert summary_text(state.blocks, True, state).plain.endswith("after step 2")
    assert "abort" not in phase_text(state).plain


def test_the_block_table_of_a_request_with_samples_names_the_sample_it_shows():
    """Trial 37e: n=2, sample 0 ended while sample 1 decoded; the caption read "Block table of cmpl-…: it holds
    no KV blocks now" beside a legend giving that request 9 used blocks. It shows the sample that holds blocks,
    named, and names sample 0 where another sample has a table too."""
    import dataclasses

    from nanovllm_tui.views.block_map import block_table_text

    pool = trial_pool(3, 40)
    (zero,) = pool.tables
    one = dataclasses.replace(zero, seq_id=1, index=1, block_table=(60, 62), num_tokens=20, num_computed_tokens=19)
    only_one = block_table_text(dataclasses.replace(pool, tables=(one,)), "req-12", {}).plain
    assert only_one.startswith("Block table req-12 sample 1 (sample 0 holds no blocks now)"), only_one
    assert "holds no KV blocks" not in only_one and "1→#62 3/16" in only_one
    both = block_table_text(dataclasses.replace(pool, tables=(one, zero)), "req-12", {}).plain
    assert both.startswith("Block table req-12 sample 0 (logical") and "2→#60 8/16" in both, both
    alone = block_table_text(pool, "req-12", {}).plain
    assert alone.startswith("Block table req-12 (logical"), alone  # one sample: nothing to name

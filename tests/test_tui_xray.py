"""The X-Ray tab at every width from 60 columns: every key position of the heatmap, each row's note,
the whole title; the step named for what it was."""

from __future__ import annotations

import pytest

from nanovllm_core.config import EngineConfig
from nanovllm_core.engine.controller import EngineController
from nanovllm_core.engine.llm_engine import LLMEngine
from nanovllm_tui.app import NanoVLLMApp
from nanovllm_tui.widgets.heatmap import LABEL, NOTE, AttentionHeatmap, column_layout
from nanovllm_tui.widgets.prompt_bar import PromptSettings
from tests.tui_helpers import send_prompt, wait_until

pytestmark = pytest.mark.anyio
SIZES = [(60, 20), (80, 24), (120, 40), (200, 60)]
# 43 tokens with the default model's tokenizer, as in the report of the cut-off heatmap
PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived a young girl named "
          "Mira who loved to explore the old paths between the tall trees every single morning before the sun "
          "came up")


def screen_text(app) -> str:
    """What the terminal shows, line by line."""
    return "\n".join("".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips())


@pytest.mark.parametrize("num_keys", [1, 43, 150, 1024])
@pytest.mark.parametrize("width", [56, 76, 116, 196])
def test_every_key_gets_a_cell_and_the_note_still_fits(num_keys, width):
    cell, per = column_layout(num_keys, width)
    cells = -(-num_keys // per)
    assert cells * per >= num_keys and LABEL + cells * cell + NOTE <= max(width, LABEL + NOTE + 1)


async def test_the_heatmap_shows_every_key_and_its_notes_at_every_width(tiny_llama_dir, tmp_path):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64))
    app = NanoVLLMApp(EngineController.from_engine(engine, start_paused=True), settings=PromptSettings(max_tokens=2, chat=False),
                      tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready)
        await pilot.press("escape", "2")
        await pilot.pause(0.2)
        assert "while this tab is open: send a prompt first (it waits while paused: then n runs one step)." in \
            " ".join(screen_text(app).split())  # the whole hint, not cut; paused with nothing sent
        n = len(engine.tokenizer.encode(PROMPT))
        assert n == 43
        await send_prompt(pilot, PROMPT, max_tokens=2)
        await pilot.press("escape", "n")  # paused: exactly the prefill step
        await wait_until(pilot, lambda: app.state.heat is not None and app.state.heat.context_len == n,
                         what="the prefill's heatmap")
        for size in SIZES:
            await pilot.resize_terminal(*size)
            await pilot.pause(0.3)
            heatmap = app.query_one(AttentionHeatmap)
            width = heatmap.scrollable_content_region.width
            assert heatmap.region.height >= 4 and width > 0, size
            cell, per = column_layout(n, width)
            assert heatmap.border_subtitle == f"keys 0-{n - 1}" + (f" · {per} keys per cell (summed)" if per > 1 else "")
            for y in range(1, heatmap.scrollable_content_region.height):
                line = heatmap.render_line(y).text
                assert len(line) <= width and "→" in line, (size, line)  # each row's note is on screen
                assert line.index("→") >= LABEL + (-(-n // per)) * cell  # after every key's cell
            text = screen_text(app)
            assert "prefill: 43 new tokens over 43 in context" in " ".join(text.split()), size
            assert "(←→)" in text, size  # the title's end is on screen


async def test_a_layer_not_captured_is_said_so_and_a_replay_does_not_promise_the_next_step(tmp_path):
    """Issue 29: the engine captures only the chosen layer. A replay of such a recording, moved to
    another layer, says which layer the step holds, and promises no capture (a recording cannot)."""
    import gzip

    from nanovllm_core import events as ev
    from tests.tui_helpers import XRAY_TRACE, replay_app

    lines = gzip.open(XRAY_TRACE, "rt").read().splitlines()
    kept = [line for line in lines if '"type":"LayerTrace"' not in line or ev.from_json(line).layer == 0]
    assert len(kept) < len(lines)  # the recording held other layers: now only layer 0's remain
    trace = tmp_path / "one_layer.jsonl"
    trace.write_text("\n".join(kept) + "\n")
    app = replay_app(tmp_path, trace=trace)
    async with app.run_test(size=(120, 40)) as pilot:
        app.controller.step(1)
        await wait_until(pilot, lambda: 0 in app.state.xray, 20, "layer 0's trace")
        await pilot.press("escape", "2", "down")
        await pilot.pause(0.2)
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        step = app.state.xray[0].step
        assert f"Layer 1 was not captured in step {step} (it captured layer 0)" in title
        assert "This recording holds only the layers captured while it was made" in title
        assert "next traced step" not in title
        # the selected request finished: no step of it will come (trial 9: 'the next traced step captures' it)
        rid = app.state.xray[0].request_id
        app.select(rid)
        app.state.requests[rid].state = "finished"
        app.query_one("#xray-view").update_view(app.state, rid)
        await pilot.pause(0.2)
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        assert f"Request {rid} is finished (no longer running), so no step of it will capture layer 1" in title

"""Trial 22b: the X-Ray's title row kept the height of the title shown before it (a four-line title cut
after two lines, "(a step is traced only while it"; a one-line title after a three-line one left blank
rows), and under --connect a request the server rejected was asked for by id (a false 404 toast)."""

from __future__ import annotations

import pytest

from tests.tui_helpers import send_prompt, tiny_app, visible_tab, wait_until

pytestmark = pytest.mark.anyio


def title_fits(app) -> tuple[int, int, str]:
    """(rows the title has on screen, rows its text wraps to, its text)."""
    title = app.query_one("#xray-title")
    text = title._shown  # the rich Text it was given last
    wrapped = len(text.wrap(app.console, title.content_region.width))
    return title.region.height, wrapped, text.plain


async def test_the_xray_title_row_fits_each_title_whole_when_its_line_count_changes(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path, start_paused=True, max_tokens=12)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the model")
        await send_prompt(pilot, "one two three")
        first = app.selected
        await send_prompt(pilot, "four five six")
        await pilot.press("escape", "2")
        await wait_until(pilot, lambda: visible_tab(app) == "xray", 10, "the X-Ray tab")
        app.select(first)
        await pilot.pause(0.2)
        seen = set()
        shown, wrapped, text = title_fits(app)
        assert shown == wrapped, text  # "No trace yet: ..."
        seen.add(wrapped)
        for _ in range(2):
            await pilot.press("n")
            await wait_until(pilot, lambda: app.state.xray and not app.state.step_open, 30, "a traced step")
        await pilot.pause(0.2)
        shown, wrapped, text = title_fits(app)
        assert shown == wrapped, text
        seen.add(wrapped)
        await pilot.press("1", "a")  # abort the first, one step hidden
        await pilot.press("n")
        await wait_until(pilot, lambda: not app.state.step_open, 30, "the step")
        await pilot.press("2")
        await pilot.pause(0.3)
        shown, wrapped, text = title_fits(app)
        assert shown == wrapped, text
        seen.add(wrapped)
        await pilot.press("1")
        for _ in range(14):  # the second runs to its end while the tab is hidden
            if not any(r.live for r in app.state.requests.values()):
                break
            await pilot.press("n")
            await wait_until(pilot, lambda: not app.state.step_open, 30, "the step")
        await pilot.press("bracketright", "2")
        await pilot.pause(0.3)
        shown, wrapped, text = title_fits(app)
        assert shown == wrapped, text
        seen.add(wrapped)
        app.select(first)
        await pilot.pause(0.3)
        shown, wrapped, text = title_fits(app)
        assert shown == wrapped, text
        seen.add(wrapped)


async def test_a_live_static_title_shows_every_line_as_it_changes_between_1_2_and_4_lines_also_after_hiding():
    """The kind of the fault in ``LiveStatic``: content given while its tab is hidden (no width to wrap
    at) or before a resize, then content of another line count at 120x40."""
    import itertools

    from rich.text import Text
    from textual.app import App
    from textual.widgets import Static, TabbedContent, TabPane

    from nanovllm_tui.widgets.live import LiveStatic

    def words(lines: int, tag: str) -> Text:  # wraps to ``lines`` lines in 118 cells
        return Text(tag + " " + " ".join(["word"] * (lines * 23 - 4)))

    class Tabs(App):
        CSS = "LiveStatic { height: auto; padding: 0 1; }"

        def compose(self):
            with TabbedContent(id="tabs"):
                with TabPane("one", id="one"):
                    yield Static("the other tab")
                for k in range(9):
                    with TabPane(f"t{k}", id=f"t{k}"):
                        yield LiveStatic(id=f"title{k}")
                        yield Static("below")

    app = Tabs()
    async with app.run_test(size=(120, 40)) as pilot:
        tabs = app.query_one("#tabs", TabbedContent)
        for k, counts in enumerate(itertools.product([1, 2, 4], repeat=2)):
            title = app.query_one(f"#title{k}", LiveStatic)
            title.show_content(Text("X-Ray\n").append_text(words(counts[0], "hidden")))  # never shown: no width
            await pilot.pause()
            for n, count in enumerate(counts[1:] + counts[:1]):
                tabs.active = f"t{k}"
                await pilot.pause()
                assert title.region.height == len(title._shown.wrap(app.console, 118)), (counts, n)
                title.show_content(words(count, f"shown{n}"))
                await pilot.pause()
                assert title.region.height == count, (counts, n)
                tabs.active = "one"
                await pilot.pause()


async def test_under_connect_a_rejected_request_is_never_asked_for_and_the_xray_says_it_was_rejected(tiny_server,
                                                                                                     tmp_path):
    """Trial 22b bug 4: selecting a request the server rejected asked the server to X-Ray it: a false
    "the id is wrong, or it ended long ago (HTTP 404)" toast at each selection."""
    from nanovllm_core.sampling_params import SamplingParams
    from tests.tui_helpers import attached_and_paused

    async with attached_and_paused(tiny_server, tmp_path) as (app, pilot, notes):
        await pilot.press("2")
        await wait_until(pilot, lambda: visible_tab(app) == "xray", 10, "the X-Ray tab")
        rid = app.submit_request("Tell me more", SamplingParams(max_tokens=10**6))
        await wait_until(pilot, lambda: app.state.requests[rid].state == "rejected", 10, "the rejection")
        app.select(None)
        app.select(rid)  # as ] / [ select it again
        await pilot.pause(1.0)
        assert not notes.find("xray"), [n.message for n in notes.items]
        title = " ".join(app.query_one("#xray-title")._shown.plain.split())
        assert f"request {rid} was rejected (" in title and "it never ran, so it has nothing to trace" in title, title
        await pilot.press("a")  # nothing to abort: said here, nothing sent
        await pilot.pause(0.5)
        assert notes.find(f"{rid} is already rejected; nothing to abort"), [n.message for n in notes.items]
        assert not notes.find("HTTP 404"), [n.message for n in notes.items]

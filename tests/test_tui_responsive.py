"""Keys while the engine works (issue 29, item 10): the mechanisms that keep a key's redraw short
and ahead of the engine. How fast that is on a busy host is measured by
``benchmarks/benchmark_tui.py --burners 2``, not here."""

from __future__ import annotations

import pytest

from nanovllm_tui.widgets.footer import SteadyFooter, shown_keys
from tests.tui_helpers import tiny_app, visible_tab, wait_until


@pytest.mark.anyio
async def test_tab_keys_leave_the_footer_alone_and_a_change_of_keys_redraws_it(tiny_llama_dir, tmp_path):
    app = tiny_app(tiny_llama_dir, tmp_path)  # live: a replay has no prompt to focus
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the tiny model")
        await pilot.press("escape")
        footer = app.query_one(SteadyFooter)
        await wait_until(pilot, lambda: footer.drawn is not None, timeout=10, what="the footer")
        await pilot.pause(0.2)
        before, changes, last = footer.rebuilds, 0, footer.drawn
        for key, tab in (("5", "blocks"), ("1", "dashboard"), ("5", "blocks"), ("1", "dashboard"), ("2", "xray"),
                         ("1", "dashboard")):
            await pilot.press(key)
            await wait_until(pilot, lambda: visible_tab(app) == tab, timeout=10, what=tab)
            await pilot.pause(0.1)
            changes += shown_keys(app.screen) != last
            last = shown_keys(app.screen)
            assert footer.drawn == last, f"after {key} the footer shows other keys than the {tab} tab's"
        # The focus moved six times; the footer was rebuilt only where a tab brought keys of its own
        # (the X-Ray's layer and head keys), not for the Block Map and Dashboard switches.
        assert footer.rebuilds - before == changes < 6
        # Settle first: on a loaded host a redraw asked for by the last tab switch may still be queued.
        await wait_until(pilot, lambda: footer.drawn == shown_keys(app.screen), timeout=10, what="a settled footer")
        await pilot.pause(0.5)
        before, keys_before = footer.rebuilds, footer.drawn
        app.query_one("#prompt").focus()  # the prompt bar adds "esc Leave prompt": that is a change
        await wait_until(pilot, lambda: any(label == "Leave prompt" for _key, label, *_ in footer.drawn or ()),
                         timeout=10, what="the prompt's keys in the footer")
        assert footer.rebuilds == before + 1, (keys_before, footer.drawn)
        assert footer.drawn == shown_keys(app.screen)

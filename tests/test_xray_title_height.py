"""The X-Ray's title row held at most 4 lines: below ~100 columns a longer title (a rejected request's
reason, a finished request's explanation) was cut with no sign of more (left open in trial 22b's fix)."""

from __future__ import annotations

import pytest

from nanovllm_tui.widgets.live import LiveStatic
from tests.tui_helpers import replay_app, visible_tab, wait_until

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("size", [(80, 24), (60, 20)])
async def test_a_long_xray_title_is_shown_whole_at_small_sizes(tmp_path, size):
    app = replay_app(tmp_path)
    async with app.run_test(size=size) as pilot:
        await pilot.press("escape", "2")
        await wait_until(pilot, lambda: visible_tab(app) == "xray", 10, "the X-Ray tab")
        title = app.query_one("#xray-title", LiveStatic)
        long = ("request req-9 was rejected (the prompt may need 17 KV blocks (68 tokens) but the pool has only 10; "
                "raise --num-kv-blocks or lower --max-tokens): it never ran, so it has nothing to trace. Pick another "
                "request with [ and ], or send a prompt: the first request of each step is traced meanwhile, "
                "and its layers are shown here once a step has run.")
        title.show_content(long)
        await pilot.pause(0.3)
        wrapped = len(title._shown.wrap(app.console, title.content_region.width))
        assert wrapped > 4 and title.region.height == wrapped, (wrapped, title.region.height)

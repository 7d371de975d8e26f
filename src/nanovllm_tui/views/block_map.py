"""Block Map: every physical KV block, who owns it, what is shared or cached, and one block table."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from nanovllm_tui.widgets.live import LiveStatic

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import plural
from nanovllm_tui import hints
from nanovllm_tui.state import EngineState, after_aborts
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.block_grid import CACHED_COLOR, FREE_COLOR, BlockGrid
from nanovllm_tui.widgets.format import request_colors


def summary_text(blocks: ev.BlocksChanged, prefix_caching: bool | None = None, state: EngineState | None = None,
                 live: bool = True) -> Text:
    """The pool in one line; ``prefix_caching`` False (the engine's model info): the hit rate is
    not shown as 0% but the cache as off (trial 10). ``state``: the engine's, to say when the
    snapshot is older than its newest ended step (:func:`snapshot_age`)."""
    used, cached = blocks.states.count("u"), blocks.states.count("c")
    shared = sum(1 for r in blocks.ref_counts if r > 1)
    text = Text.assemble(
        (plural(blocks.num_blocks, "block"), "bold"), f" × {blocks.block_size} tokens · ",
        (f"{used} used", "bold"), f" ({shared} shared) · ", (f"{cached} cached-free", CACHED_COLOR), " · ",
        (f"{blocks.num_blocks - used - cached} free", "grey62"),
        " · prefix caching off" if prefix_caching is False else f" · prefix-cache hit rate {blocks.prefix_cache_hit_rate:.0%}",
        f" · after step {blocks.step}")
    # taken after an abort between steps (while paused): not the step's pool alone (trial 36c's kind)
    text.append(after_aborts(state.blocks_aborts if state is not None and state.blocks is blocks else []))
    age = snapshot_age(blocks, state, live) if state is not None else ""
    if age:
        text.append(f" · {age}", style="bold yellow")
    return text


def snapshot_age(blocks: ev.BlocksChanged, state: EngineState, live: bool = True) -> str:
    """"" while ``blocks`` is the pool after the newest ended step; else what a reader needs to know
    beside its older figures: a snapshot is sent only while a tab shows it, so the map last seen
    came back at first (trial 14a: "after step 53" at step 119 while the Dashboard had newer counts).
    The app asks for a fresh one when the tab is shown (``NanoVLLMApp._set_detail``): the engine
    takes it at the end of the step it is running. A replay has only what was recorded."""
    newest = state.timings[-1].step if state.timings else None
    if newest is None or blocks.step >= newest:
        return ""
    if not live:
        return f"the recording holds no map after it (step {newest} has ended)"
    if state.step_open and state.step is not None and state.step > newest:
        return f"old (the engine is at step {state.step}): a new map comes at the end of that step"
    return f"old (step {newest} has ended): a new map is on its way"


def legend_text(blocks: ev.BlocksChanged, colors: dict[str, str]) -> Text:
    text = Text()
    owners = list(dict.fromkeys(t.request_id for t in blocks.tables))
    for rid in owners:
        text.append("██", style=colors.get(rid, "white"))
        text.append(f" {rid}  ")
    if owners:
        text.append("\n")
    # every part-filled height (trial 45c: "▂▂" was drawn and only "▄▄" listed); the glyph's height is how full
    text.append("██ full  ▁▂▃▄▅▆▇ part-filled (taller: fuller)  ╌╌ allocated, empty  ")
    text.append("◆◆", style="bold")
    text.append(" shared (ref > 1)  ")
    text.append("░░", style=CACHED_COLOR)
    text.append(" cached-free  ")
    text.append("··", style=FREE_COLOR)
    text.append(" free  ")
    text.append("underlined", style="underline")
    text.append(": selected")
    return text


def block_table_text(blocks: ev.BlocksChanged, selected: str | None, colors: dict[str, str],
                     width: int = 0, height: int = 0, console=None) -> Text:
    """The selected request's block table: logical block -> physical block, and slots filled.

    ``width``/``height``: the panel's content cells, and ``console`` to wrap with; a table longer than
    fits keeps its first and last entries (the last is the part-filled one a reader looks for) and
    says how many between are hidden (trial 18a: at 120x40 the panel cut "21→#98 15/16" off with no
    sign of more). 0 or no ``console``: every entry."""
    # sample 0's table, as the other views follow sample 0; when it holds none now (ended, preempted) while
    # another sample of the request runs on, that sample's, named (trial 37e: "holds no KV blocks now" beside a
    # legend giving the same request 9 blocks)
    samples = sorted((t for t in blocks.tables if t.request_id == selected), key=lambda t: t.index)
    table = samples[0] if samples else None
    if table is None:
        who = selected or "no request selected"
        return Text(f"Block table of {who}: it holds no KV blocks now (waiting, finished, or not selected).",
                    style="dim")
    sample = "" if table.index == 0 and len(samples) == 1 else f" sample {table.index}"
    if table.index:
        sample += " (sample 0 holds no blocks now)"
    bs = blocks.block_size
    color = colors.get(table.request_id, "white")
    entries = []
    for i, b in enumerate(table.block_table):
        filled = min(bs, max(0, table.num_computed_tokens - i * bs))
        ref = blocks.ref_counts[b]
        entries.append(Text.assemble((f"{i}→#{b}", f"bold {color}"),
                                     f" {filled}/{bs}" + (f" ref {ref}" if ref > 1 else "") + "  "))
    allocated = len(table.block_table) * bs
    unfilled = allocated - table.num_computed_tokens
    computed, blocks_held = table.num_computed_tokens, plural(len(table.block_table), 'block')
    footers = (f"\n{computed} of its {plural(table.num_tokens, 'token')} {'has' if computed == 1 else 'have'} KV, "
               f"in {blocks_held} = {plural(allocated, 'slot')}: {plural(unfilled, 'slot')} allocated but unfilled",
               f"\n{computed}/{table.num_tokens} tokens have KV in {blocks_held}; {unfilled} unfilled")
    heads = (" (logical → physical, slots with KV):  ", ":  ")

    def assemble(head: int, tail: int, short: int = 0) -> Text:
        text = Text.assemble(("Block table ", "bold"), (table.request_id, f"bold {color}"), (sample, "bold"),
                             heads[short])
        hidden = len(entries) - head - tail
        for entry in entries[:head]:
            text.append_text(entry)
        if hidden > 0:
            text.append(f"… {hidden} more ({head}–{len(entries) - tail - 1}) …  ", style="bold")
        for entry in entries[len(entries) - tail:] if tail else []:
            text.append_text(entry)
        text.append(footers[short])
        return text

    whole = assemble(len(entries), 0)
    if width <= 0 or height <= 0 or console is None or len(whole.wrap(console, width)) <= height:
        return whole
    for short in (0, 1):  # the long wording first; fewer entries until they fit, the last one always
        for shown in range(len(entries) - 1, 0, -1):
            tail = max(1, shown // 3)
            text = assemble(shown - tail, tail, short)
            if len(text.wrap(console, width)) <= height:
                return text
    return assemble(0, 1, 1)  # narrower than any fit: the panel cuts its end


class BlockMapView(EngineView):
    """The KV pool as PagedAttention sees it, redrawn after every step while visible."""

    def compose(self) -> ComposeResult:
        yield LiveStatic(id="blocks-summary")
        yield LiveStatic(id="legend")
        yield BlockGrid(id="grid", classes="panel")
        yield LiveStatic(id="block-table", classes="panel")

    def on_mount(self) -> None:
        self.query_one("#grid").border_title = "Physical KV blocks"

    def main_widget(self) -> BlockGrid:
        return self.query_one(BlockGrid)

    def update_view(self, state: EngineState, selected: str | None) -> None:
        blocks = state.blocks
        if blocks is None:
            step = hints.next_step(state, getattr(self.app, "live", True))
            self.query_one("#blocks-summary", LiveStatic).show_content(
                Text(state.no_engine or f"The block map appears after the next engine step ({step}).", style="dim"))
            self.query_one("#legend", LiveStatic).show_content("")
            self.query_one("#block-table", LiveStatic).show_content("")
            self.query_one(BlockGrid).set_data(None, {}, None)
            return
        colors = request_colors(state.requests)
        self.query_one("#blocks-summary", LiveStatic).show_content(
            summary_text(blocks, state.model_info.get("prefix_caching"), state, getattr(self.app, "live", True)))
        self.query_one("#legend", LiveStatic).show_content(legend_text(blocks, colors))
        self.query_one(BlockGrid).set_data(blocks, colors, selected)
        panel = self.query_one("#block-table", LiveStatic)
        region = panel.content_region
        panel.show_content(block_table_text(blocks, selected, colors, region.width, region.height, self.app.console))

    def on_resize(self) -> None:
        """The panel's room changed: fit the block table to it again (also while paused, when no
        frame of events would redraw it)."""
        self.call_after_refresh(self._refit)

    def _refit(self) -> None:
        app = self.app
        shown = app.query(f"#{app.active_tab}-view").first(None) if app.is_running else None
        if shown is self and getattr(app, "_mounted", False):
            self.update_view(app.state, app.selected)

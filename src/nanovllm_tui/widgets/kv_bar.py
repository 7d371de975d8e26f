"""The KV cache memory bar: blocks used, cached-free and free, and their bytes."""

from __future__ import annotations

from rich.text import Text

from nanovllm_tui.state import EngineState, after_aborts
from nanovllm_core.educational.commentary import plural
from nanovllm_core.educational.tp_facts import across_ranks, tp_size
from nanovllm_tui.widgets.format import first_fitting, fmt_bytes
from nanovllm_tui.widgets.live import LiveStatic

USED, CACHED, FREE = ("█", "#4ea1ff"), ("▒", "#2ec4d6"), ("░", "grey42")


class KVMemoryBar(LiveStatic):
    """``KV ███▒▒░░░░  12 used · 3 cached · 497 free of 512 blocks``, then the bytes.

    Cached-free blocks hold a finished prefix that a new prompt may reuse (prefix caching)
    until the pool needs them back.
    """

    def title_for(self, state: EngineState) -> str:
        """The border's title names the step its figures are after (as the Block Map's "after step N"):
        while a step runs the header names that step, and the pool is drawn as the last finished one left it
        (trial 13: "running · step 46" beside step 45's 5 blocks read as one state)."""
        kv = state.kv
        if kv is not None and kv.num_blocks_total:
            whens = [f"after step {kv.step}"]
            aborts = state.step_aborts
            if aborts:  # aborted between steps (while paused): the figures are after those too (trial 36c)
                whens = [whens[0] + after_aborts(aborts),
                         whens[0] + (" and an abort" if len(aborts) == 1 else after_aborts(aborts))]
        elif state.model_info and not state.no_engine:
            whens = ["before any step"]
        else:
            return "KV cache memory"
        room = self.size.width - 4  # the border's corners and the spaces around the title
        for when in whens:
            for title in (f"KV cache memory · {when}", f"KV cache · {when}", f"KV · {when}"):
                if not room or len(title) <= room:
                    return title
        return whens[-1]

    def show(self, state: EngineState) -> None:
        kv = state.kv
        info = state.model_info
        self.border_title = self.title_for(state)
        if state.no_engine:
            self.show_content(Text(f"KV cache: {state.no_engine}", style="dim"))
            return
        if kv is not None and kv.num_blocks_total:
            total, used, cached = kv.num_blocks_total, kv.num_blocks_used, kv.num_blocks_cached
            bytes_total = kv.kv_bytes_total
        elif info:
            total, used, cached = info.get("num_kv_blocks", 0), 0, 0
            bytes_total = total * info.get("block_size", 0) * info.get("kv_bytes_per_token", 0)
        else:
            self.show_content(Text("KV cache: waiting for the model", style="dim"))
            return
        free = total - used - cached
        width = max(10, self.size.width - 10)
        cells = [round(used / total * width), round(cached / total * width)] if total else [0, 0]
        if used and not cells[0]:
            cells[0] = 1  # one used block must show
        cells.append(max(0, width - sum(cells)))
        text = Text("KV cache ", style="bold")
        for (glyph, color), n in zip((USED, CACHED, FREE), cells):
            text.append(glyph * n, style=color)
        per_block = bytes_total / total if total else 0
        width = self.content_region.width
        text.append("\n")
        text.append_text(first_fitting(width, Text.assemble(
            (f"{USED[0]} used {used}", USED[1]),
            f" ({fmt_bytes(used * per_block)}{f' over {tp_size(info or {})} ranks' if tp_size(info or {}) > 1 else ''})  ",
            (f"{CACHED[0]} cached-free {cached}", CACHED[1]), "  ", (f"{FREE[0]} free {free}", "grey62")),
            # the bytes go before "cached-free" is cut to "cached" (at 100 columns it read "cached 7": trial 39e)
            Text.assemble((f"{USED[0]} used {used}", USED[1]), "  ", (f"{CACHED[0]} cached-free {cached}", CACHED[1]),
                          "  ", (f"{FREE[0]} free {free}", "grey62")),
            Text.assemble((f"{USED[0]} used {used}", USED[1]), "  ", (f"{CACHED[0]} cached {cached}", CACHED[1]),
                          "  ", (f"{FREE[0]} free {free}", "grey62"))))
        text.append("\n")
        n = tp_size(info or {})
        if n > 1:  # the engine's KV byte figures are totals over the ranks: say so (trial 16c)
            text.append_text(first_fitting(
                width, Text(f"of {plural(total, 'block')}, {fmt_bytes(per_block)} a block{across_ranks(per_block, n, fmt_bytes)}: "
                            f"{fmt_bytes(bytes_total)} in all{across_ranks(bytes_total, n, fmt_bytes)}", style="dim"),
                Text(f"of {plural(total, 'block')}: {fmt_bytes(bytes_total)}{across_ranks(bytes_total, n, fmt_bytes)}",
                     style="dim"),
                Text(f"of {plural(total, 'block')}: {fmt_bytes(bytes_total)} over {n} ranks", style="dim")))
        else:
            text.append_text(first_fitting(
                width, Text(f"of {plural(total, 'block')}, {fmt_bytes(per_block)} each: {fmt_bytes(bytes_total)} in all", style="dim"),
                Text(f"of {plural(total, 'block')}: {fmt_bytes(bytes_total)}", style="dim")))
        self.show_content(text)

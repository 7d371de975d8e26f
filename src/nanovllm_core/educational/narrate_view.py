"""``--narrate``: the narrator's commentary printed in the terminal with Rich, as the engine runs.

Each :class:`~nanovllm_core.educational.narrator.Commentary` becomes a headline naming its
act (tokenization, embedding, prefill, decode, ...), the explanation, and for decode steps a
table of the top candidates with their probabilities as bars. Rich only; printed through the
shared console, so it lands above a live dashboard when one is showing.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group, RenderableType
from rich.text import Text

from nanovllm_core import events as ev
from nanovllm_core.educational.narrator import Commentary, Narrator
from nanovllm_core.educational.rich_parts import Indent, topk_table

ACTS: dict[str, tuple[str, str]] = {  # kind -> (label, style)
    "model": ("THE MODEL", "bold white"),
    "tokenization": ("ACT 1 · TOKENIZATION", "bold cyan"),
    "sampling": ("SAMPLING SETTINGS", "magenta"),
    "embedding": ("ACT 2 · EMBEDDING", "bold blue"),
    "attention": ("ATTENTION", "blue"),
    "prefill": ("ACT 3 · PREFILL", "bold green"),
    "chunked_prefill": ("ACT 3 · CHUNKED PREFILL", "bold green"),
    "decode": ("ACT 4 · DECODE", "bold yellow"),
    "kv_cache": ("KV CACHE", "bold bright_blue"),
    "scheduler": ("SCHEDULER", "bold bright_magenta"),
    "preemption": ("PREEMPTION", "bold red"),
    "prefix_cache": ("PREFIX CACHE", "bold bright_green"),
    "speculative": ("SPECULATIVE DECODING", "bold bright_cyan"),
    "communication": ("TENSOR PARALLEL", "bold bright_yellow"),
    "finished": ("FINISHED", "bold white"),
    "rejected": ("REJECTED", "bold red"),
    "error": ("ENGINE ERROR", "bold red"),
}
def render_commentary(c: Commentary) -> RenderableType:
    """One entry: ``▌ ACT · step N · title`` then the text indented, then its table if any.

    The act is the kind's (``ACTS``), or act 3's with the entry's own ``heading`` where it has one
    (the token a prefill's last position chose: "ACT 3 · FIRST TOKEN").

    ``step N`` whenever the entry belongs to a step and its title does not already begin with
    "Step N" (trial 12: a KV CACHE entry with step 12's numbers printed under step 3's decode,
    with nothing to tell them apart; the app's narrator names the step the same way).
    """
    label, style = ACTS.get(c.kind, (c.kind.upper(), "bold"))
    if c.heading:  # a token chosen by a prefill's last position: act 3's, not a decode step's (trial 42a)
        label = f"{ACTS['prefill'][0].split(' · ')[0]} · {c.heading.upper()}"
    step = f" · step {c.step}" if c.step is not None and not c.title.startswith(f"Step {c.step}") else ""
    head = Text.assemble(("▌ " + label, style), f"{step} · {c.title}")
    parts: list[RenderableType] = [head, Indent(Text(c.text))]
    if c.table:
        if c.table_title:
            parts.append(Indent(Text(f"({c.table_title})", style="italic")))
        parts.append(Indent(topk_table(c.table, notes=c.table_notes)))
    return Group(*parts, Text(""))


class NarrateView:
    """Feeds events to a :class:`Narrator` and prints each entry to ``console`` as it is complete.

    Args:
        console: where to print (the CLI's shared console).
        model_info: ``LLMEngine.model_info()``, for the model entry and the numbers in the text.
        max_decode_steps: decode entries per request (None: all), see ``Narrator``.
        kinds: print only these kinds (None: all), e.g. a tutorial demonstration's.
        kv_every_step: a KV cache entry after every step, not only when blocks changed.
    """

    def __init__(self, console: Console, model_info: dict[str, Any] | None = None,
                 max_decode_steps: int | None = 10, kinds: tuple[str, ...] | None = None,
                 kv_every_step: bool = False) -> None:
        self.console = console
        self.narrator = Narrator(model_info, max_decode_steps_per_request=max_decode_steps, kv_every_step=kv_every_step)
        self.kinds = kinds
        self.entries: list[Commentary] = []

    def __call__(self, event: ev.Event) -> None:
        for c in self.narrator.feed(event):
            self.show(c)

    def show(self, c: Commentary) -> None:
        """Print one entry (unless its kind is filtered out) and keep it in ``entries``."""
        if self.kinds is not None and c.kind not in self.kinds:
            return
        self.entries.append(c)
        self.console.print(render_commentary(c))

    def close(self) -> None:
        """Print whatever an unfinished step left buffered."""
        for c in self.narrator.flush():
            self.show(c)

    def subscribe(self, engine) -> Any:
        """Subscribe to ``engine`` with the detail the narrator uses (top-5, block tables)."""
        return engine.subscribe(self, topk=5, blocks=True, xray=False)

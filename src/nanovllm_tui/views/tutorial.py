"""Tutorial: twelve chapters, each with a live demonstration on the engine and a quiz.

The chapters, demonstrations, grading and saved progress come from
``nanovllm_core.educational.tutorial`` (the CLI's ``--tutorial`` reads the same), so this tab
only lays them out and wires the keys: ←/→ chapters, A-D (or ↑/↓ and Enter) answers,
``r`` runs the chapter's demonstration. Progress is saved after every answer and chapter
change, and loaded at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import OptionList, Static

from nanovllm_core.educational import tutorial as tut
from nanovllm_core.educational.narrator import Commentary
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.commentary import commentary_text
from nanovllm_tui.widgets.live import LiveStatic

MAX_DEMO_NOTES = 60


class QuizChoices(OptionList):
    """The four answers. A-D answer at once; ↑/↓ and Enter too; PageUp/PageDown scroll the chapter."""

    BINDINGS = [
        Binding("a,A", "answer(0)", "Answer A-D"),
        Binding("b,B", "answer(1)", "B", show=False),
        Binding("c,C", "answer(2)", "C", show=False),
        Binding("d,D", "answer(3)", "D", show=False),
        Binding("left", "chapter(-1)", "Prev chapter"),
        Binding("right", "chapter(1)", "Next chapter"),
        Binding("pageup", "scroll_chapter(-1)", "Scroll up", show=False),
        Binding("pagedown", "scroll_chapter(1)", "Scroll down", show=False),
    ]

    def action_chapter(self, delta: int) -> None:
        # OptionList binds ←/→ to scrolling; here they turn the tutorial's pages.
        self.query_ancestor(TutorialView).action_chapter(delta)

    def action_answer(self, index: int) -> None:
        self.highlighted = index
        self.action_select()

    def action_scroll_chapter(self, direction: int) -> None:
        scroll = self.screen.query_one("#chapter-scroll", VerticalScroll)
        (scroll.scroll_page_down if direction > 0 else scroll.scroll_page_up)(animate=False)


@dataclass
class DemoRun:
    """A demonstration in progress: its requests (sent one by one when ``sequential``) and what it showed."""

    demo: tut.Demo
    chapter: tut.Chapter
    queue: list[tut.DemoRequest]
    request_ids: list[str] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)
    notes: list[Commentary] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Every request has been sent."""
        return not self.queue

    @property
    def finished(self) -> bool:
        """Every request has been sent and has ended."""
        return self.done and self.ended >= set(self.request_ids)


class TutorialView(EngineView):
    """One chapter at a time: its text, this model's real numbers, its live demonstration, its quiz."""

    BINDINGS = [
        Binding("left", "chapter(-1)", "Prev chapter"),
        Binding("right", "chapter(1)", "Next chapter"),
        Binding("r", "run_demo", "Run demo"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._progress: tut.TutorialProgress | None = None
        self._drawn = False
        self._notes_shown = 0
        self.feedback: Text | None = None
        self.run: DemoRun | None = None
        self._info: dict[str, Any] = {}

    @property
    def progress(self) -> tut.TutorialProgress:
        """Saved progress, read when the tab is first shown (finding the default file imports the
        model loader, and with it torch: not something to wait for before the window appears)."""
        if self._progress is None:
            self._progress = tut.TutorialProgress.load(self.progress_path)
        return self._progress

    @property
    def progress_path(self) -> Path | None:
        """The app's ``tutorial_path`` (None: the tutorial module's default file)."""
        return self.app.tutorial_path

    @property
    def chapter(self) -> tut.Chapter:
        return tut.CHAPTERS[self.progress.current]

    def compose(self) -> ComposeResult:
        yield Static(id="chapter-list", classes="panel")
        with Vertical(id="chapter-pane"):
            with VerticalScroll(id="chapter-scroll", classes="panel"):
                yield Static(id="chapter-text")
                yield LiveStatic(id="demo-log")
            with Vertical(id="quiz", classes="panel"):
                yield Static(id="question")
                yield QuizChoices(id="choices")
                yield Static(id="feedback")

    def on_mount(self) -> None:
        self.query_one("#chapter-list").border_title = "Chapters"
        self.query_one("#quiz").border_title = "Quiz"

    def main_widget(self) -> QuizChoices:
        return self.query_one(QuizChoices)

    # ------------------------------------------------------------------ drawing

    def update_view(self, state: EngineState, selected: str | None) -> None:
        if not self._drawn:
            self._drawn = True
            self._info = dict(state.model_info)
            self._show_chapter()
        elif state.model_info != self._info:
            self._info = dict(state.model_info)
            self._show_text()
        self._show_demo()

    def _show_chapter(self) -> None:
        """Draw everything that depends on the current chapter."""
        self._show_list()
        self._show_text()
        self._show_demo()
        quiz = self.chapter.quiz
        self.query_one("#question", Static).update(Text(quiz.question, style="bold"))
        choices = self.query_one(QuizChoices)
        choices.clear_options()
        choices.add_options([f"{tut.LETTERS[i]}. {c}" for i, c in enumerate(quiz.choices)])
        previous = self.progress.answers.get(self.chapter.key)
        choices.highlighted = previous if previous is not None else 0
        self.feedback = self._feedback(previous) if previous is not None else None
        self._show_feedback()
        self.query_one("#chapter-scroll", VerticalScroll).scroll_home(animate=False)

    def _show_list(self) -> None:
        text = Text()
        for i, c in enumerate(tut.CHAPTERS):
            answer = self.progress.answers.get(c.key)
            mark, style = ("·", "dim") if answer is None else (("✓", "green") if answer == c.quiz.answer else ("✗", "red"))
            current = i == self.progress.current
            text.append(f"{mark} ", style=style)
            text.append(f"{c.number:>2} {c.title.split(':')[0][:25]}\n", style="bold reverse" if current else "")
        text.append(f"\nScore {self.progress.score}/{self.progress.answered} answered", style="bold")
        text.append(f"\n{len(tut.CHAPTERS) - self.progress.answered} to go · ←/→ chapters", style="dim")
        self.query_one("#chapter-list", Static).update(text)

    def _show_text(self) -> None:
        c = self.chapter
        text = Text(f"Chapter {c.number} of {len(tut.CHAPTERS)}: {c.title}\n\n", style="bold")
        for paragraph in c.paragraphs:
            text.append(paragraph + "\n\n")
        facts = tut.model_facts(c, self._info)
        if facts:
            text.append("On the model loaded now\n", style="bold #4ea1ff")
            for line in facts:
                text.append(f"  {line}\n", style="#4ea1ff")
            text.append("\n")
        demo = tut.DEMOS.get(c.demo) if c.demo else None
        if demo is not None:
            text.append(f"Live demonstration: {demo.title}. ", style="bold #3ecf8e")
            text.append(f"{demo.watch} Press r to run it on the engine.", style="#3ecf8e")
        self.query_one("#chapter-text", Static).update(text)

    def _show_demo(self) -> None:
        run = self.run
        log = self.query_one("#demo-log", LiveStatic)
        if run is None or run.chapter is not self.chapter:
            log.show_content("")
            return
        text = Text(f"\nDemonstration: requests {', '.join(run.request_ids)}", style="bold")
        if not run.done:
            text.append(f" ({len(run.queue)} more to send)", style="dim")
        text.append(" · finished" if run.finished else " · running", style="dim")
        for note in run.notes[-MAX_DEMO_NOTES:]:
            text.append("\n\n")
            text.append_text(commentary_text(note))
        log.show_content(text)
        if len(run.notes) != self._notes_shown:  # new output: bring it into view
            self._notes_shown = len(run.notes)
            scroll = self.query_one("#chapter-scroll", VerticalScroll)
            self.call_after_refresh(scroll.scroll_end, animate=False)  # once the new lines are laid out

    def _show_feedback(self) -> None:
        self.query_one("#feedback", Static).update(self.feedback or Text("A-D, or ↑/↓ and Enter, to answer.",
                                                                         style="dim"))

    def _feedback(self, choice: int) -> Text:
        quiz = self.chapter.quiz
        right = choice == quiz.answer
        text = Text("✓ Right. " if right else f"✗ Not quite: the answer is {tut.LETTERS[quiz.answer]}. ",
                    style="bold green" if right else "bold red")
        text.append(quiz.explanation)
        return text

    # ------------------------------------------------------------------ keys

    def action_chapter(self, delta: int) -> None:
        self.progress.current = (self.progress.current + delta) % len(tut.CHAPTERS)
        self._save()
        self._show_chapter()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.answer(event.option_index)

    def answer(self, choice: int) -> bool:
        """Grade ``choice`` (0-3) for the current chapter, show the feedback, keep the progress."""
        right = self.progress.record(self.chapter, choice)
        self.feedback = self._feedback(choice)
        self._save()
        self._show_feedback()
        self._show_list()
        return right

    def _save(self) -> None:
        try:
            self.progress.save(self.progress_path)
        except OSError as e:
            self.notify(f"Tutorial progress could not be saved: {e}", severity="warning", markup=False)

    # ------------------------------------------------------------------ demonstrations

    def action_run_demo(self) -> None:
        c = self.chapter
        demo = tut.DEMOS.get(c.demo) if c.demo else None
        if demo is None or not c.demo_prompt:
            self.notify("This chapter has no live demonstration.", severity="warning")
            return
        if not self.app.live:
            self.notify("Demonstrations run on a live engine; this is a replay.", severity="warning")
            return
        if self.run is not None and not self.run.finished:
            self.notify("The demonstration is still running.", severity="warning")
            return
        if self.app.state.paused:
            self.notify("The engine is paused: the demonstration's requests wait until you press space (or n).")
        self.run = DemoRun(demo, c, demo.requests(c.demo_prompt))
        self._notes_shown = -1
        self.app.demo_started(demo)
        self._send_next()
        if not demo.sequential:
            while not self.run.done:
                self._send_next()
        self._show_demo()

    def _send_next(self) -> None:
        request = self.run.queue.pop(0)
        rid = self.app.submit_request(request.prompt, request.params, request.priority)
        self.run.request_ids.append(rid)

    def add(self, notes: list[Commentary]) -> None:
        """Keep the narrator entries that belong to the running demonstration."""
        run = self.run
        if run is None or run.finished:
            return
        for note in notes:
            if note.kind in run.demo.kinds and (note.request_id in run.request_ids or note.request_id is None):
                run.notes.append(note)

    def request_ended(self, request_id: str) -> None:
        """A request finished or was refused: a sequential demonstration sends its next one."""
        run = self.run
        if run is None or request_id not in run.request_ids or request_id in run.ended:
            return
        run.ended.add(request_id)
        if not run.done:
            self._send_next()
        elif run.finished:
            self.app.demo_finished(run.demo)
        self._show_demo()

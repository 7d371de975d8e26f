"""Tutorial: thirteen chapters, each with a live demonstration on the engine and a quiz.

The chapters, demonstrations, grading and saved progress come from
``nanovllm_core.educational.tutorial`` (the CLI's ``--tutorial`` reads the same), so this tab
only lays them out and wires the keys: ←/→ chapters, A-D (or ↑/↓ and Enter) answers (an answered
quiz keeps its answer; ``x`` clears it to answer again),
``r`` runs the chapter's demonstration (the tensor-parallel chapter's first measures all-reduces
between local processes on a worker thread). Progress is saved after every answer and chapter
change, and loaded at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import OptionList, Static

from nanovllm_core.educational import tp_facts
from nanovllm_core.educational import tutorial as tut
from nanovllm_core.educational.commentary import weights_label
from nanovllm_core.educational.tp_facts import (
    SPLIT_UNAVAILABLE,
    communication_words,
    split_engine_available,
    split_run_words,
)
from nanovllm_core.host_load import HostCheck
from nanovllm_tui.bridge import EngineBridge
from nanovllm_tui.demo_session import DemoSession
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.widgets.commentary import commentary_text
from nanovllm_tui.widgets.live import LiveStatic
from nanovllm_tui.options import VISIT_ONLY

MAX_DEMO_NOTES = 60


class QuizChoices(OptionList):
    """The four answers. A-D answer at once; ↑/↓ and Enter too; PageUp/PageDown scroll the chapter, Home/End
    to its start or end (and the highlight to the first or last answer);
    ↓ on D (↑ on A) scrolls the quiz box on (back) when its verdict is longer than the box's view.

    An answered quiz keeps its answer: A-D (and Enter) then say it is answered and that ``x`` clears it
    to answer again, and the footer offers ``x Retry quiz`` in place of ``a Answer A-D``. Trial 16: a
    learner pressed ``a`` (Abort everywhere else) on an answered chapter and lost a correct answer
    that is kept between launches (13/13 became 12/13) without a word."""

    BINDINGS = [
        Binding("a,A", "answer(0)", "Answer A-D"),
        Binding("b,B", "answer(1)", "B", show=False),
        Binding("c,C", "answer(2)", "C", show=False),
        Binding("d,D", "answer(3)", "D", show=False),
        # an answered quiz (check_action): the same keys say so and keep the answer
        Binding("a,A,b,B,c,C,d,D", "answered", "Answered", show=False),
        Binding("x", "retry", "Retry quiz"),
        Binding("left", "chapter(-1)", "Prev chapter"),
        Binding("right", "chapter(1)", "Next chapter"),
        Binding("pageup", "scroll_chapter(-1)", "Scroll up", show=False),
        Binding("pagedown", "scroll_chapter(1)", "Scroll down", show=False),
        # the chapter's start and end, and the first or last answer as OptionList's own Home/End (trial 44e pressed
        # End to read the rest of a chapter and nothing moved but the highlight)
        Binding("home", "scroll_chapter(-2)", "Chapter top", show=False),
        Binding("end", "scroll_chapter(2)", "Chapter end", show=False),
    ]

    def action_chapter(self, delta: int) -> None:
        # OptionList binds ←/→ to scrolling; here they turn the tutorial's pages.
        self.query_ancestor(TutorialView).action_chapter(delta)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A-D answer an unanswered quiz; on an answered one they say so (``answered``) and ``x`` clears it."""
        if action in ("answer", "answered", "retry"):
            views = self.ancestors_with_self
            view = next((v for v in views if isinstance(v, TutorialView)), None)
            answered = view is not None and view.answered
            return answered if action != "answer" else not answered
        return super().check_action(action, parameters)

    def action_answer(self, index: int) -> None:
        self.highlighted = index
        self.action_select()

    def action_select(self) -> None:
        """Enter (and A-D, and a click): grade the highlighted answer at once. OptionList posts an
        ``OptionSelected`` message instead, handled after any key behind it in the same terminal read:
        ``b →`` answered the NEXT chapter's quiz with B (trial 24a)."""
        view = next((v for v in self.ancestors_with_self if isinstance(v, TutorialView)), None)
        if self.highlighted is not None and view is not None:
            view.answer(self.highlighted)

    def action_answered(self) -> None:
        self.query_ancestor(TutorialView).say_answered()

    def action_retry(self) -> None:
        self.query_ancestor(TutorialView).retry()

    def option_region(self, index: int) -> Region | None:
        """Where option ``index`` lies in the quiz box's scrolled space (None before it is laid out)."""
        self._update_lines()
        try:
            y, height = self._index_to_line[index], self._heights[index]
        except (KeyError, IndexError):
            return None
        box = self.virtual_region
        return Region(box.x, box.y + self.gutter.top + y, box.width, height)

    def scroll_to_highlight(self, top: bool = False) -> None:
        """Also bring the highlighted option into the quiz box's view: the box scrolls
        (app.tcss), and ↓ to D moved the highlight below its fold (trial 12, 60x20)."""
        super().scroll_to_highlight(top)
        if self.highlighted is not None and self.is_mounted:
            self.call_after_refresh(self._reveal, self.highlighted)

    def _reveal(self, index: int) -> None:
        region = self.option_region(index)
        if region is not None and self.highlighted == index and isinstance(self.parent, Widget):
            self.parent.scroll_to_region(region, animate=False, immediate=True)

    def action_cursor_down(self) -> None:
        """↓ on the last option scrolls the quiz box on (a verdict longer than the box's view: trial 20a
        found no key that reached the rest of it); elsewhere it moves the highlight."""
        if self._past_end(1):
            return
        super().action_cursor_down()

    def action_cursor_up(self) -> None:
        """↑ on the first option scrolls the quiz box back (to the question above it)."""
        if self._past_end(-1):
            return
        super().action_cursor_up()

    def _past_end(self, direction: int) -> bool:
        """On the last option going down (first going up), scroll the quiz box a line that way if it can
        (True: done so, the highlight stays)."""
        box = self.parent
        last = self.option_count - 1 if direction > 0 else 0
        if self.highlighted != last or not isinstance(box, Widget):
            return False
        if direction > 0 and box.scroll_y < box.max_scroll_y:
            box.scroll_relative(y=1, animate=False, immediate=True)
            return True
        if direction < 0 and box.scroll_y > 0:
            box.scroll_relative(y=-1, animate=False, immediate=True)
            return True
        return False

    def action_scroll_chapter(self, direction: int) -> None:
        """The chapter's text a page down (1) or up (-1), or to its end (2) or start (-2), where the highlight
        goes to the last or first answer too (OptionList's End and Home)."""
        scroll = self.screen.query_one("#chapter-scroll", VerticalScroll)
        if abs(direction) == 2:
            (self.action_last if direction > 0 else self.action_first)()
            (scroll.scroll_end if direction > 0 else scroll.scroll_home)(animate=False)
            return
        (scroll.scroll_page_down if direction > 0 else scroll.scroll_page_up)(animate=False)


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
        self.session: DemoSession | None = None
        self._info: dict[str, Any] = {}
        # A demonstration that measures all-reduces (tensor parallelism): its chapter and what it found.
        self.measured: tuple[tut.Chapter, Text] | None = None
        self.measuring = False

    @property
    def progress(self) -> tut.TutorialProgress:
        """Saved progress, read when the tab is first shown (finding the default file imports the
        model loader, and with it torch: not something to wait for before the window appears)."""
        if self._progress is None:
            # a --web visitor's app keeps its progress for the visit only (one file would be every visitor's)
            self._progress = (tut.TutorialProgress() if self.app.tutorial_path is VISIT_ONLY else
                              tut.TutorialProgress.load(self.progress_path))
            if self._progress.notice:
                self.app.notify(self._progress.notice, severity="warning", timeout=15, markup=False)
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
        self.refresh_bindings()  # r is offered only where this chapter's demonstration can run
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
        self.query_one("#quiz").scroll_home(animate=False)  # a short terminal's quiz scrolls: its question first

    def _show_list(self) -> None:
        text = Text()
        for i, c in enumerate(tut.CHAPTERS):
            answer = self.progress.answers.get(c.key)
            mark, style = ("·", "dim") if answer is None else (("✓", "green") if answer == c.quiz.answer else ("✗", "red"))
            current = i == self.progress.current
            text.append(f"{mark} ", style=style)
            text.append(f"{c.number:>2} {c.title.split(':')[0][:25]}\n", style="bold reverse" if current else "")
        # "12/13 answered" beside "0 to go" read as 12 of 13 answered (trial 26b): say which count is which
        text.append(f"\nScore {self.progress.score} right of {self.progress.answered} answered", style="bold")
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
            text.append(f"Live demonstration: {tut.demo_heading(c, app=True)}. ", style="bold #3ecf8e")
            refused = self.refusal("run_demo")  # a replay or --connect hides r: say why, not "Press r" (trial 14a's kind)
            press = ("Press r to measure it." if demo.allreduce_ranks else  # no engine of its own (trial 16c)
                     "Press r to run it on a small engine of its own, over the loaded model.")
            split = self._split_ranks() if self.app.live else 1  # a split app is its own split run (trial 17b #3)
            text.append(f"{demo.app_text(split)} " + (refused or press), style="#3ecf8e")
        self.query_one("#chapter-text", Static).update(text)

    @property
    def run(self):
        """The newest demonstration's :class:`~nanovllm_tui.demo_session.DemoRun`, or None."""
        return self.session.run if self.session is not None else None

    def _show_demo(self) -> None:
        run = self.run
        log = self.query_one("#demo-log", LiveStatic)
        measured = self.measured[1] if self.measured and self.measured[0] is self.chapter else None
        if run is None or run.chapter is not self.chapter:
            log.show_content(measured or "")
            return
        text = Text(f"\nDemonstration: requests {', '.join(run.request_ids)}", style="bold")
        if not run.done:
            text.append(f" ({len(run.queue)} more to send)", style="dim")
        text.append(" · finished" if run.finished else " · running", style="dim")
        text.append(f"\nOn its own engine over the loaded model: {run.settings}.", style="dim")
        text.append_text(self._now(run))
        if run.error:
            text.append(f"\n{run.error}", style="red")
        if run.finished and not run.notes:
            text.append("\nThe engine produced no commentary of this kind.", style="yellow")
        for note in run.notes[-MAX_DEMO_NOTES:]:
            text.append("\n\n")
            text.append_text(commentary_text(note))
        log.show_content(measured + text if measured else text)
        if len(run.notes) != self._notes_shown:  # new output: bring it into view
            self._notes_shown = len(run.notes)
            self._scroll_to_demo()

    def _scroll_to_demo(self) -> None:
        """Bring the demonstration's newest output (under the chapter's text) into view."""
        scroll = self.query_one("#chapter-scroll", VerticalScroll)
        self.call_after_refresh(scroll.scroll_end, animate=False)  # once the new lines are laid out

    @staticmethod
    def _what(s) -> str:
        """``decode``, ``verify 1 + 4`` (a speculative verification: the newest token and its drafts), ``prefill 12``
        or ``prefill 1 + verify 3`` (a prompt's last token and the drafts after it)."""
        if s.kind == "decode":
            return "decode" if s.num_tokens == 1 else f"verify 1 + {s.num_tokens - 1}"
        return f"prefill {s.num_own_tokens}" + (f" + verify {s.num_drafts}" if s.num_drafts else "")

    @staticmethod
    def _now(run) -> Text:
        """The demo engine's newest step: who ran (and how), who waited, preemptions so far."""
        plan = run.plan
        if plan is None:
            return Text("")
        ran = ", ".join(f"{s.request_id} {TutorialView._what(s)}" for s in plan.scheduled if s.index == 0)
        text = Text(f"\nStep {plan.step}: ran {ran or 'nothing'}", style="#3ecf8e")
        waiting = [q.request_id for q in plan.waiting if q.index == 0]
        text.append(f" · waiting: {', '.join(waiting)}" if waiting else " · nobody waiting", style="#f5a524")
        if run.preemptions:
            text.append(f" · preemptions so far: {run.preemptions}", style="bold red")
        return text

    def _show_feedback(self) -> None:
        self.query_one("#feedback", Static).update(self.feedback or Text("A-D, or ↑/↓ and Enter, to answer.",
                                                                         style="dim"))

    def _feedback(self, choice: int, again: bool = False) -> Text:
        """The verdict on ``choice`` with the explanation, and how to answer again (``again``: a key
        tried to answer the answered quiz, said first)."""
        quiz = self.chapter.quiz
        right = choice == quiz.answer
        text = Text()
        if again:
            text.append(f"Already answered ({tut.LETTERS[choice]}): the answer is kept. ", style="bold yellow")
        text.append("✓ Right. " if right else f"✗ Not quite: the answer is {tut.LETTERS[quiz.answer]}. ",
                    style="bold green" if right else "bold red")
        text.append(quiz.explanation)
        text.append("\nPress x to clear this answer and try again.", style="dim")
        return text

    @property
    def answered(self) -> bool:
        """The current chapter's quiz has a kept answer."""
        return self.chapter.key in self.progress.answers

    def say_answered(self) -> None:
        """A-D or Enter on an answered quiz: keep the answer, say so and how to answer again."""
        previous = self.progress.answers[self.chapter.key]
        self.query_one(QuizChoices).highlighted = previous
        self.feedback = self._feedback(previous, again=True)
        self._show_feedback()
        self.call_after_refresh(self._reveal_feedback)

    def retry(self) -> None:
        """``x``: clear the current chapter's answer (saved), so A-D answer it again."""
        if self.progress.answers.pop(self.chapter.key, None) is None:
            return
        self._save()
        self.feedback = None
        self._show_feedback()
        self._show_list()
        self.refresh_bindings()  # a-d answer again; x goes from the footer

    # ------------------------------------------------------------------ keys

    def action_chapter(self, delta: int) -> None:
        self.progress.current = (self.progress.current + delta) % len(tut.CHAPTERS)
        self._save()
        self._show_chapter()

    def answer(self, choice: int) -> bool:
        """Grade ``choice`` (0-3) for the current chapter, show the feedback, keep the progress; on an
        answered chapter, keep its answer and say so (True: the kept answer is right)."""
        if self.answered:
            self.say_answered()
            return self.progress.answers[self.chapter.key] == self.chapter.quiz.answer
        right = self.progress.record(self.chapter, choice)
        self.refresh_bindings()  # answered: x retries, a-d say so
        self.feedback = self._feedback(choice)
        self._save()
        self._show_feedback()
        self._show_list()
        # The quiz box scrolls (app.tcss): the verdict came below its fold, and the
        # key changed nothing visible (trial 11, 60x20). Bring it into view once laid out.
        self.call_after_refresh(self._reveal_feedback)
        return right

    def _reveal_feedback(self) -> None:
        self.query_one("#quiz").scroll_to_widget(self.query_one("#feedback"), animate=False, top=True)

    def _save(self) -> None:
        if self.app.tutorial_path is VISIT_ONLY:
            return
        try:
            self.progress.save(self.progress_path)
        except OSError as e:
            self.notify(f"Tutorial progress could not be saved: {e}", severity="warning", markup=False)

    # ------------------------------------------------------------------ demonstrations

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``r`` is offered (footer, key) only where it can run this chapter's demonstration: not in a
        replay, not under ``--connect`` (except the all-reduce measurement, which runs here), not on a
        chapter without one. Elsewhere it could only refuse (issue 29)."""
        if action != "run_demo":
            return True
        c = self.chapter
        demo = tut.DEMOS.get(c.demo) if c.demo else None
        if demo is None or not c.demo_prompt or not self.app.live:
            return False
        if demo.allreduce_ranks:
            return True  # separate processes of its own: runs beside any engine (trial 16c)
        return bool(getattr(self.app.controller, "local_engine", True)) and self._split_ranks() == 1

    def _split_ranks(self) -> int:
        """Over how many ranks the app's own engine is split (1: one process, or not known yet). Its loaded
        model is then rank 0's shard whose all-reduces belong to that engine's process group: a demonstration
        engine over it would wait on ranks that never join, and the group's timeout kills the app's engine
        (trial 17b #1). From the model's facts, or from the engine's settings before they arrive."""
        engine = getattr(self.app.controller, "engine", None) if self.app.live else None
        config = getattr(engine, "config", None)
        n = getattr(config, "tensor_parallel_size", 1)
        return max(tp_facts.tp_size(self._info), n if isinstance(n, int) and not isinstance(n, bool) else 1, 1)

    def refusal(self, action: str) -> str | None:
        """Why ``action`` is not offered here, naming what was refused (the app shows it when the hidden
        key is pressed anyway); None for an action this view does not refuse."""
        if action != "run_demo" or self.check_action(action, ()) is not False:
            return None
        c = self.chapter
        demo = tut.DEMOS.get(c.demo) if c.demo else None
        if demo is None or not c.demo_prompt:
            return f"No demonstration to run: chapter {c.number} has none."
        if not self.app.live:
            return ("No demonstration in a replay: demonstrations run on a local engine and a replay only plays "
                    "a recording; start without --replay to run one.")
        split = self._split_ranks()
        if split > 1 and getattr(self.app.controller, "local_engine", True):
            return (f"No demonstration beside an engine split over {split} ranks: a demonstration builds an engine "
                    "over the whole loaded model, and here that is rank 0's shard; run `nanovllm --tutorial "
                    f"--tutorial-chapter {c.number}` in a terminal.")
        return ("No demonstration under --connect: demonstrations run on a local engine of their own, and this app "
                "watches a server; start nanovllm-tui without --connect to run one.")

    def action_run_demo(self) -> None:
        c = self.chapter
        demo = tut.DEMOS.get(c.demo) if c.demo else None
        if demo is None or not c.demo_prompt or not self.app.live:
            self.notify(self.refusal("run_demo") or "", severity="warning", markup=False)
            return
        if (self.run is not None and not self.run.finished) or self.measuring:
            self.notify("The demonstration is still running.", severity="warning")
            return
        if demo.allreduce_ranks:
            self._measure(c, demo)  # the whole demonstration here: the split run is the CLI's (split_run_words)
            return
        if not self.check_action("run_demo", ()):  # --connect (the server's engine), or a split app engine
            self.notify(self.refusal("run_demo") or "", severity="warning", markup=False)
            return
        engine = self.app.controller.engine
        if engine is None:
            self.notify("The model is still loading: press r again once it is ready.", severity="warning")
            return
        self._stop_session()
        try:
            self.session = DemoSession(self, engine, demo, c, fps=1 / self.app.bridge.frame_s)
        except (ValueError, RuntimeError) as e:  # settings this model cannot take: say so, keep the app
            self.notify(f"The demonstration could not start: {e}", severity="error", markup=False)
            return
        self._notes_shown = -1
        self.session.start()
        self._show_demo()

    def _measure(self, chapter: tut.Chapter, demo: tut.Demo) -> None:
        """Time all-reduces between ``demo.allreduce_ranks`` local processes on a worker thread (the ranks
        start as fresh interpreters from this many-threaded process: seconds), then show the figures."""
        try:
            hidden, layers = int(self._info["hidden_size"]), int(self._info["num_layers"])
        except (KeyError, TypeError, ValueError):
            self.notify("The model's sizes are not known yet: press r again once it is ready.", severity="warning")
            return
        self.measuring = True
        self.session = None  # an earlier demonstration's notes are not this one's
        self.measured = (chapter, Text(f"\nMeasuring all-reduces between {demo.allreduce_ranks} processes "
                                       "(gloo over 127.0.0.1)…", style="dim"))
        self._show_demo()
        self._scroll_to_demo()  # under a long chapter's text it was out of view (trial 11, as the quiz's verdict)
        # the heading promises a one-process decode step measured now beside the all-reduces (trial 16a #3)
        local = getattr(self.app.controller, "local_engine", True)
        split = tp_facts.tp_size(self._info)  # a split engine's model here is rank 0's shard: no one-process run
        main_engine = getattr(self.app.controller, "engine", None) if local and split == 1 else None

        def work() -> None:
            from nanovllm_core.educational import tp_measure
            from nanovllm_core.educational.tutorial_demos import EngineDemos

            try:
                check = HostCheck()  # over both measurements: a busy host's figures are told as such (trial 34e)
                m = tp_measure.measure_allreduce(demo.allreduce_ranks, hidden=hidden, iters=200, warmup=20)
                timed = []
                if main_engine is not None:  # the chapter's prompt on one process, over the loaded model
                    demos = EngineDemos.from_loaded(main_engine.model, main_engine.tokenizer, main_engine.resolved,
                                                    device=str(main_engine.device),
                                                    dtype=str(main_engine.dtype).replace("torch.", ""))
                    timed = demos.one_process_decode_steps(demo, chapter)
                text = Text("\n" + communication_words(m, tp_facts.allreduces_per_step(layers), timed,
                                                        chapter.demo_prompt, weights=weights_label(self._info),
                                                        busy=check.note()),
                            style="#ffd166")
                if not timed:
                    text.append(" " + tp_facts.app_no_baseline(local, split) + ".")
                missing = SPLIT_UNAVAILABLE if not split_engine_available() else split_run_words(self._info)
                text.append("\n" + missing[0].upper() + missing[1:] + ".", style="yellow")
            except (RuntimeError, ValueError, OSError) as e:
                text = Text(f"\nThe all-reduce measurement failed: {e}", style="red")
            self.app.call_from_thread(self._measured, chapter, text)

        self.run_worker(work, thread=True, exclusive=True, exit_on_error=False, group="allreduce")

    def _measured(self, chapter: tut.Chapter, text: Text) -> None:
        self.measuring = False
        self.measured = (chapter, text)
        self._show_demo()
        if chapter is self.chapter:
            self._scroll_to_demo()

    def on_engine_bridge_events_ready(self, message: EngineBridge.EventsReady) -> None:
        """The demonstration's engine sent events (its own bridge, never the app's)."""
        message.stop()
        if self.session is not None:
            self.session.take(self.session.bridge.drain())
            self._show_demo()

    def _stop_session(self) -> None:
        if self.session is not None:
            self.session.stop(wait=False)

    def on_unmount(self) -> None:
        self._stop_session()

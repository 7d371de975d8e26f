"""``--tutorial``: the thirteen chapters and their quizzes in a plain terminal (Rich).

Each chapter shows its explanation, runs its live demonstration on the engine (unless demos
are off), asks its question (A-D), says whether the answer was right with the explanation,
and keeps a running score; Enter moves to the next chapter. Progress (the chapter reached
and every answer) is saved after each answer, in ``<cache_root()>/tutorial_progress.json``
unless another file is given, and the next launch resumes where the learner stopped.

Input: on a terminal, single key presses (A-D, Enter, q). Otherwise answers are read line
by line, so the tutorial can be scripted: per chapter one line with the answer, then one
(empty) line for Enter, except after the last chapter. A line that is not A-D is asked
again; ``q``, at the question or at "Press Enter to continue", or the end of input ends the
tutorial with the score so far.

The model is loaded only for the first demonstration (``demos=False`` never loads it); each
demonstration builds a small engine over the loaded weights with the settings its
``Demo.engine`` asks for, so chunking, waiting and preemption actually happen.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from nanovllm_core.educational.rich_parts import Indent
from nanovllm_core.educational.tutorial import (CHAPTERS, DEMOS, LETTERS, Chapter, TutorialProgress, choice_index,
                                                demo_heading, model_facts)

QUIT = "quit"


class LineInput:
    """Answers read line by line from a stream (a pipe, a file, a test's StringIO)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def read(self, prompt: str, console: Console) -> str | None:
        """The next line without its newline; None at end of input."""
        console.print(Text(prompt, style="bold"), end="")
        line = self.stream.readline()
        if not line:
            console.print()
            return None
        console.print(Text(line.rstrip("\n")))
        return line.rstrip("\r\n")


class KeyInput:
    """Key presses on a POSIX terminal (cbreak mode); Ctrl-C and Ctrl-D end the tutorial.

    An answer's key (A-D, or q) acts at once, without Enter. Any other key begins a word read up to
    Enter (Backspace edits it), so a wrong word is one wrong answer told once: "hello" and Enter were
    six answers, each refused with its own line (trial 28a)."""

    KEYS_AT_ONCE = frozenset("abcdqABCDQ")

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def read(self, prompt: str, console: Console) -> str | None:
        import termios
        import tty

        console.print(Text(prompt, style="bold"), end="")
        fd = self.stream.fileno()
        old = termios.tcgetattr(fd)
        word = ""
        try:
            tty.setcbreak(fd)
            while True:
                ch = self.stream.read(1)
                if ch in ("", "\x03", "\x04"):
                    word = None
                    break
                if ch in "\r\n":
                    break
                if not word and ch in self.KEYS_AT_ONCE:
                    word = ch
                    console.print(Text(ch), end="")
                    break
                if ch in ("\x7f", "\b"):  # Backspace: the word's last character goes
                    if word:
                        word = word[:-1]
                        console.print("\b \b", end="", markup=False, highlight=False)
                    continue
                if ch.isprintable():
                    word += ch
                    console.print(Text(ch), end="")
        except KeyboardInterrupt:
            word = None
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, old)
        console.print()
        return word


def input_for(stream: TextIO) -> LineInput | KeyInput:
    """Key presses when ``stream`` is a terminal that supports it, else lines."""
    try:
        if stream.isatty():
            import termios  # noqa: F401  (POSIX only)

            return KeyInput(stream)
    except (ImportError, AttributeError, ValueError):
        pass
    return LineInput(stream)


@dataclass
class TutorialResult:
    """What one run of the tutorial did: chapters asked, right answers, whether it reached the end."""

    asked: int = 0
    right: int = 0
    completed: bool = False
    chapters: list[str] = field(default_factory=list)


DemoRunner = Callable[[Chapter, Console], None]


def run_tutorial(console: Console, stream: TextIO | None = None, progress_path: Path | None = None,
                 start: int | None = None, demo_runner: DemoRunner | None = None,
                 model_info: dict[str, Any] | None = None) -> TutorialResult:
    """Run the tutorial from chapter index ``start`` (None: where the saved progress stopped).

    Args:
        console: where to print.
        stream: where answers come from (default ``sys.stdin``).
        progress_path: the progress file (default ``<cache_root()>/tutorial_progress.json``).
        start: 0-based chapter index to begin at.
        demo_runner: runs a chapter's demonstration (None: no demonstrations).
        model_info: the model's facts, when it is loaded, for the "on this model" lines.

    Returns:
        the run's :class:`TutorialResult`. Progress is saved after every answer; a file that
        cannot be written is reported once and the tutorial goes on.
    """
    reader = input_for(stream if stream is not None else sys.stdin)
    progress = TutorialProgress.load(progress_path)
    if progress.notice:
        console.print(Text(f"Note: {progress.notice}.", style="yellow"))
    if start is None:
        start = progress.current
        if start:
            console.print(Text(f"Resuming at chapter {start + 1} (start over with --tutorial-chapter 1).", style="dim"))
    result = TutorialResult()
    console.print(Rule(Text("nano-vLLM tutorial: how an inference engine serves a prompt", style="bold cyan")))
    console.print(Text(f"{len(CHAPTERS)} chapters, each with a question. Answer with A, B, C or D; q quits.\n"))
    save_error = [False]

    def save() -> None:
        try:
            progress.save(progress_path)
        except OSError as e:
            if not save_error[0]:
                console.print(Text(f"Note: progress cannot be saved ({e}); the tutorial goes on.", style="yellow"))
                save_error[0] = True

    for index in range(start, len(CHAPTERS)):
        ch = CHAPTERS[index]
        progress.current = index
        show_chapter(console, ch, model_info)
        if demo_runner is not None and ch.demo is not None:
            run_demo_safely(console, ch, demo_runner)
        answer = ask(console, reader, ch)
        if answer is None:
            save()
            break
        right = progress.record(ch, answer)
        result.asked += 1
        result.right += right
        result.chapters.append(ch.key)
        console.print(Indent(feedback(ch, answer, right), 0))
        console.print(Text(f"Score: {result.right}/{result.asked}", style="bold"))
        last = index == len(CHAPTERS) - 1
        progress.current = 0 if last else index + 1
        save()
        if last:
            result.completed = True
            break
        if wants_to_quit(reader.read("Press Enter to continue (q quits)... ", console)):
            break
    console.print(Rule())
    console.print(Text(f"Final score: {result.right}/{result.asked}", style="bold green"))
    kept = "Progress (not saved)" if save_error[0] else "Saved progress"
    console.print(Text(f"{kept}: {progress.score} of {len(CHAPTERS)} chapters answered right "
                       f"({progress.answered} answered).", style="dim"))
    return result


# A chapter's own words for what follows it on the loaded model: its figures and its demonstration
REFERS_TO_FIGURES = re.compile(r"\b(figures|numbers) below\b|\bthe demonstration\b")


def show_chapter(console: Console, ch: Chapter, model_info: dict[str, Any] | None) -> None:
    """The chapter's heading, its paragraphs, and real numbers about the loaded model if known."""
    console.print(Rule(Text(f"Chapter {ch.number} of {len(CHAPTERS)}: {ch.title}", style="bold cyan"), align="left"))
    for p in ch.paragraphs:
        console.print(Indent(Text(p)))
        console.print()
    for line in model_facts(ch, model_info or {}):
        console.print(Indent(Text("On this model: " + line, style="cyan")))
        console.print()
    if model_info is None and REFERS_TO_FIGURES.search(" ".join(ch.paragraphs)):
        # --no-demos (or a model that did not load): the text's "figures below" never come (trial 27a)
        console.print(Indent(Text("No model is loaded, so the figures and the demonstration this chapter refers "
                                  "to are not shown here; run `nanovllm --tutorial` without --no-demos to see them.",
                                  style="yellow")))
        console.print()


def run_demo_safely(console: Console, ch: Chapter, demo_runner: DemoRunner) -> None:
    """Announce and run the chapter's demonstration; a failure is printed as one line, never raised."""
    demo = DEMOS[ch.demo]
    console.print(Text(f"Live demonstration: {demo_heading(ch)}", style="bold magenta"))
    console.print(Indent(Text("Watch: " + demo.watch, style="magenta")))
    console.print()
    try:
        demo_runner(ch, console)
    except Exception as e:  # a demo never ends the tutorial
        console.print(Text(f"The demonstration could not run: {type(e).__name__}: {e}", style="yellow"))


def wants_to_quit(line: str | None) -> bool:
    """True at the end of input or for ``q`` / ``quit`` (any case), wherever the tutorial waits for a key."""
    return line is None or line.strip().lower() in ("q", "quit")


def ask(console: Console, reader, ch: Chapter) -> int | None:
    """Show the quiz and read an answer until it is A-D; None on quit or end of input."""
    q = ch.quiz
    console.print(Indent(Text("Quiz: " + q.question, style="bold yellow"), 0))
    for letter, choice in zip(LETTERS, q.choices):
        console.print(Indent(Text(f"[{letter}] {choice}")))
    while True:
        line = reader.read("Your answer (A-D): ", console)
        if wants_to_quit(line):
            return None
        try:
            return choice_index(line)
        except ValueError:
            console.print(Text("Please answer with A, B, C or D (or q to quit).", style="yellow"))


def feedback(ch: Chapter, answer: int, right: bool) -> Text:
    """Right or not, the right choice, and the quiz's explanation."""
    q = ch.quiz
    correct = f"{LETTERS[q.answer]}) {q.choices[q.answer]}"
    if right:
        head = (f"Right: {correct}. ", "bold green")
    else:
        head = (f"Not quite: you chose {LETTERS[answer]}; the answer is {correct}. ", "bold red")
    return Text.assemble(head, q.explanation)

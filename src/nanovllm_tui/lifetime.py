"""How an app process ends: on SIGTERM, SIGINT and SIGHUP, and under ``--web`` when its page goes away.

A signal asks the app to quit as ``q`` does (the engine stops, trace files close, the terminal
leaves the alternate screen). Under ``--web`` textual-serve starts one app process per page and
talks to it over stdin/stdout: it says ``quit`` when the page closes, and when the web server
itself is gone the process's stdin ends, which Textual's web driver takes silently (issue 29:
processes of closed pages kept running, 530 MB each). :class:`PageWebDriver` quits then too.

Whatever asked the app to quit, a watchdog ends the process ``EXIT_GRACE_S`` seconds later if
it is still there (a wedged engine thread or a starved event loop must not keep it alive).

Nor does the app end when it should not: Textual's terminal driver decodes input as strict
UTF-8, so pasting invalid UTF-8 ended its input thread and the app, with status 0 (issue 29).
:func:`tolerate_bad_input` makes it decode with U+FFFD replacements instead.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
import signal
import sys
import threading
import time
from typing import Any

from textual import messages
from textual.drivers.web_driver import WebDriver

EXIT_GRACE_S = 5.0
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_RESTORE_TERMINAL = "\x1b[?1049l\x1b[?25h\x1b[?1000l\x1b[?1003l\x1b[?1006l\x1b[?2004l"  # main screen, cursor, no mouse

_watchdog: threading.Timer | None = None


def end_within(seconds: float = EXIT_GRACE_S, status: int = 1, terminal: bool = True) -> None:
    """End this process ``seconds`` from now unless it has ended by then (started once; a daemon timer).

    ``terminal``: first put a terminal back as the app found it (main screen, cursor shown).
    """
    global _watchdog
    if _watchdog is not None:
        return

    def force() -> None:
        if terminal and sys.__stdout__ is not None and sys.__stdout__.isatty():
            try:
                sys.__stdout__.write(_RESTORE_TERMINAL)
                sys.__stdout__.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    _watchdog = threading.Timer(seconds, force)
    _watchdog.daemon = True
    _watchdog.start()


def leave_when_engines_stop(status: int, seconds: float = EXIT_GRACE_S, ignore: frozenset = frozenset()) -> None:
    """After the app has ended: end the process past an engine thread still inside a step
    (``nanovllm_core.yield_gate.leave_when_engines_stop``, which ``nanovllm serve`` uses too).

    The app stops its engines before it ends, but only waits a second for the step in flight (a
    long prefill on a busy host can take longer, as can a tutorial demo's engine): that step stops
    at its next layer boundary (trial 12c: q during a 1,520-token prefill took over 6 s) and the
    process ends under it, skipping the teardown that would abort (status 134, issue 29's trial).
    """
    from nanovllm_core import yield_gate

    yield_gate.leave_when_engines_stop(status, seconds, ignore)


def end_on_early_signals() -> None:
    """Until :func:`quit_on_signals` takes over (the app's event loop is up), SIGTERM, SIGINT and
    SIGHUP end the process within :data:`EXIT_GRACE_S` seconds, status 128 + the signal's number.

    A signal that came while the app was still starting (loading its modules, before ``on_mount``)
    used to meet Python's default: SIGINT became a KeyboardInterrupt the starting app could swallow,
    and a page's process stayed alive (issue 29's web visitors). Call from the main thread.
    """
    def on_signal(signum: int, frame: Any) -> None:
        end_within(status=128 + signum)

    for signum in SIGNALS:
        try:
            signal.signal(signum, on_signal)
        except (ValueError, OSError):  # not the main thread
            pass


def quit_on_signals(app: Any) -> None:
    """SIGTERM, SIGINT and SIGHUP quit ``app`` as ``q`` does, status 128 + the signal's number
    (call on the app's event loop, in the main thread).

    Plain ``signal.signal`` handlers, not the loop's ``add_signal_handler``: those run only when
    the loop turns, and a page's app whose main thread waits on a full stdout pipe (the browser
    side gone) never turned it again. A plain handler runs even then (Python retries the write
    after running it), starts the watchdog (:func:`end_within`) and asks the loop to quit.
    """
    import asyncio

    loop = asyncio.get_running_loop()

    def graceful(signum: int) -> None:
        app.stop_engine()
        app.exit(return_code=128 + signum)

    def on_signal(signum: int, frame: Any) -> None:
        end_within(status=128 + signum)
        try:
            loop.call_soon_threadsafe(graceful, signum)
        except RuntimeError:  # the loop has closed: the watchdog ends the process
            pass

    for signum in SIGNALS:
        try:
            signal.signal(signum, on_signal)
        except (ValueError, OSError):  # not the main thread
            pass


class PageWebDriver(WebDriver):
    """Textual's web driver, ending the app when textual-serve says ``quit`` (the page closed) or
    when stdin ends (the web server is gone), within ``EXIT_GRACE_S`` seconds either way."""

    def on_meta(self, packet_type: str, payload: dict[str, object]) -> None:
        if packet_type == "quit":
            end_within(terminal=False)
        super().on_meta(packet_type, payload)

    def run_input_thread(self) -> None:
        try:
            super().run_input_thread()
        finally:
            if not self.exit_event.is_set():  # input ended without the app quitting: nobody is left to see it
                end_within(terminal=False)
                self._app.post_message(messages.ExitApp())


def tolerate_bad_input() -> None:
    """Make Textual's terminal driver decode invalid UTF-8 as U+FFFD instead of dying on it.

    Its input thread builds a strict decoder from the module's ``getincrementaldecoder``; that
    name is pointed at one that replaces what it cannot decode (Textual 8; a no-op elsewhere).
    """
    try:
        from textual.drivers import linux_driver
    except ImportError:  # not on this platform
        return
    if hasattr(linux_driver, "getincrementaldecoder"):
        linux_driver.getincrementaldecoder = lambda name: functools.partial(
            codecs.getincrementaldecoder(name), errors="replace")


# ESC and a digit (or -, =, §) that Textual's key table turns into the character WezTerm on macOS
# sends for Option and that key (ESC 3 -> "£"). A person pressing Esc then 3 quickly sends the same
# bytes: in the prompt bar it typed "£" instead of leaving the bar and showing tab 3 (issue 29, trial 7).
ESC_DIGIT_SEQUENCES = ("\x1b§", "\x1b1", "\x1b2", "\x1b3", "\x1b4", "\x1b5", "\x1b6", "\x1b7", "\x1b8", "\x1b9",
                       "\x1b0", "\x1b-", "\x1b=")


def read_esc_key_as_alt() -> None:
    """Make Textual's parser read ESC then any one key as ``alt+<key>``, so the app can take it for
    Esc then that key (``_handle_now``), where Textual reads ESC then a letter so already.

    - ESC then a digit (or -, =, §): Textual's table turned it into the character WezTerm on macOS
      sends for Option and that key ("£" for ESC 3; issue 29, trial 7). Those entries are removed:
      a "£" typed as such (shift+3 on a UK keyboard) is one character, not ESC 3, and still types
      "£"; what is lost is WezTerm's Option+digit characters in the prompt.
    - ESC then a key that is not a letter or digit (space, [, ], /): Textual dropped the ESC and
      gave the bare key (ESC space typed a space into the prompt instead of leaving the bar and
      pausing; trial 8). Such a key now comes as ``alt+space``, ``alt+left_square_bracket``, ...

    - ESC then a key, then another escape sequence in the same read (an arrow, Home, PageUp, F1,
      Delete, a paste's start; ``tmux send-keys Escape 1 Up``): the second ESC cut the first
      sequence short, and Textual re-issued it with the ESC turned into a typed "^" ("^1" went
      into the prompt and was sent to the model; trial 25b). Textual asks for the key of an ESC
      alone only there (its ``reissue_sequence_as_keys`` with ``process_alt=False``, also used
      for an unknown sequence longer than 32 characters), so an ESC alone now yields nothing and
      marks the parser, and the one character after it comes as ``alt+<key>``, as it does when
      the ESC's wait runs out: Esc, then the key, then the arrow. No ESC is ever read as "^".

    Textual 8's ``ANSI_SEQUENCES_KEYS`` and ``XTermParser._sequence_to_key_events``; another
    Textual keeps its own reading. Calling this twice is harmless."""
    try:
        from textual import events
        from textual._ansi_sequences import ANSI_SEQUENCES_KEYS
        from textual._xterm_parser import XTermParser
    except ImportError:  # another Textual: its own reading stays
        return
    for sequence in ESC_DIGIT_SEQUENCES:
        ANSI_SEQUENCES_KEYS.pop(sequence, None)
    read = getattr(XTermParser, "_sequence_to_key_events", None)
    if read is None or getattr(read, "esc_as_alt", False):
        return

    def sequence_to_key_events(self, sequence: str, alt: bool = False):
        if sequence == "\x1b" and not alt:  # an ESC cut short, re-issued: the next character is alt+ it
            self.__dict__["_esc_before_key"] = True
            return
        if len(sequence) == 1 and self.__dict__.pop("_esc_before_key", False):
            alt = True
        for key in read(self, sequence, alt=alt):
            if alt and len(sequence) == 1 and not key.key.startswith("alt+"):
                key = events.Key(f"alt+{key.key}", key.character)
            yield key

    sequence_to_key_events.esc_as_alt = True
    XTermParser._sequence_to_key_events = sequence_to_key_events


PASTE_START, PASTE_END = "\x1b[200~", "\x1b[201~"
HIDDEN = "\x1a"  # what an escape sequence inside a paste becomes: a control character the prompt bar drops and counts
# an escape sequence: CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST), DCS/SOS/PM/APC (ESC P|X|^|_ ... ST),
# or ESC and one other printable character
_SEQUENCE = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[PX^_][^\x1b]*\x1b\\|(?![\[\]PX^_])[ -~])")


class PasteEscapes:
    """Keeps escape sequences inside a bracketed paste from reaching Textual's parser as such.

    Textual 8's ``XTermParser`` ends a paste's text at the first ESC inside it: what follows
    the ESC came as typed keys *before* the paste (``abc ESC[31m def`` gave the keys ``[31mdef``,
    then a paste of ``abc``; trial 11), and outside the prompt field those keys act as the
    app's keys. This filter, between the terminal and the parser, turns every character of
    an escape sequence inside a paste into ``HIDDEN``, so the paste arrives whole and the
    prompt bar drops them and says how many (``prompt_bar.pasted_text``). Text outside a
    paste passes unchanged (a lone Esc key press is never held back). A paste's end marker
    or an escape sequence split across two reads is held until the next read completes it.
    """

    def __init__(self) -> None:
        self.in_paste = False
        self.held = ""  # inside a paste: the start of a sequence or of the end marker not yet complete
        self.tail = ""  # outside: the last characters passed on, to find a start marker split across reads

    def __call__(self, data: str) -> str:
        out: list[str] = []
        data, self.held = self.held + data, ""
        i = 0
        while i < len(data):
            if not self.in_paste:
                seen = self.tail + data[i:]
                start = seen.find(PASTE_START)
                if start < 0:
                    out.append(data[i:])
                    self.tail = seen[-(len(PASTE_START) - 1):]
                    break
                begin = start + len(PASTE_START) - len(self.tail) + i  # where the paste's text begins in data
                out.append(data[i:begin])
                i, self.tail, self.in_paste = begin, "", True
                continue
            end = data.find(PASTE_END, i)
            chunk = data[i:] if end < 0 else data[i:end]
            if end < 0:  # hold a trailing ESC: it may begin the end marker or a sequence the next read completes
                cut = chunk.rfind("\x1b")
                if cut >= 0 and not _SEQUENCE.match(chunk, cut):
                    chunk, self.held = chunk[:cut], chunk[cut:]
            out.append(_SEQUENCE.sub(lambda m: HIDDEN * len(m.group(0)), chunk).replace("\x1b", HIDDEN))
            if end < 0:
                break
            out.append(PASTE_END)
            i, self.in_paste = end + len(PASTE_END), False
        return "".join(out)


def filter_escapes_in_pastes() -> None:
    """Put a :class:`PasteEscapes` filter (one per parser) in front of Textual's ``XTermParser.feed``.
    Another Textual keeps its own reading; calling this twice is harmless."""
    try:
        from textual._xterm_parser import XTermParser
    except ImportError:
        return
    feed = XTermParser.feed
    if getattr(feed, "paste_escapes", False):
        return

    def filtered_feed(self, data: str):
        if not data:  # the end of input: passed on as it is
            return feed(self, data)
        screen = self.__dict__.setdefault("_paste_escapes", PasteEscapes())
        text = screen(data)
        return feed(self, text) if text else iter(())  # all held: nothing yet (an empty feed would mean the end)

    filtered_feed.paste_escapes = True
    XTermParser.feed = filtered_feed

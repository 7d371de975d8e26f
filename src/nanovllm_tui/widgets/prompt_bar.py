"""The prompt bar: a prompt, chat or raw, and its priority, max tokens and temperature, all from the keyboard.

The chat box says how the prompt is sent (``▐X▌ chat`` or ``▐ ▌ raw``, readable without colour): as a
user's message rendered with the model's chat template (what an instruction-tuned model expects: asked "Write a poem about the sea." as raw
text it may answer with end-of-text at once), or as raw text to continue. It starts ticked for a
model with a chat template (``--chat`` ticks it for any) and is toggled with a click, with
space when it has the focus, or with ctrl+t anywhere.

Tab goes from the prompt to priority, max tokens, temperature, then the chat box, the order they
stand in, and from the chat box round to the prompt (shift+Tab the other way); Esc leaves the bar.
Below ``ONE_LINE_WIDTH`` columns the settings take a line of their own under the prompt (at 60
columns, beside them, the prompt was 5 characters wide).

Each setting is checked as it is typed (Textual's ``Input`` validators): a wrong one turns red
and the line under the bar says why. Enter sends only when every setting is right, and at once
(not through a message that would reach the app after the keys pressed behind Enter); a prompt
is cleared only once it has been sent. A refused Enter puts the cursor in the first wrong setting
(an empty prompt too or not; with every setting right, an empty prompt gets it) and the line
under the bar says so (``PromptBar.moved_note``).

The prompt field is one line, but a prompt may have many: a paste keeps all its lines, each line
break shown as ``⏎`` (``NEWLINE_MARK``) and sent as a real newline on Enter, chat or raw (Textual's
``Input`` kept the first line only and dropped the rest without a word: trial 10). The rule is
simple and has no exception: every ``⏎`` in the field, pasted or typed, is sent as a line break.
``\r\n`` and ``\r`` count as one line break; a tab is kept (sent as a tab, shown as one cell ``⇥``,
``TAB_MARK``); every other control character of a paste (an escape sequence whole, with its
parameters) is dropped, and a toast says how many were.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Callable, Sequence

from rich.cells import cell_len, get_character_cell_size
from rich.segment import Segment
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.geometry import Region
from textual.strip import Strip
from textual.validation import ValidationResult, Validator
from textual.widgets import Checkbox, Input, Label
from textual.widgets.input import Selection

from nanovllm_core import cli_args
from nanovllm_core.sampling_params import FLOAT32_MAX, PRIORITY_MAX, check_priority
from nanovllm_tui.widgets.format import quoted

# The prompt field's hint, longest first: the longest that fits is shown (never a cut one).
EMPTY_PROMPT = "the prompt is empty: type some text, then press Enter"  # under the bar and in the toast
PLACEHOLDERS = ("Type a prompt, Enter sends it  (Esc: engine keys · / comes back)", "Type a prompt, Enter sends it",
                "Prompt, Enter sends", "Prompt")
# What a replay shows instead of the prompt bar's fields, longest first (the longest that fits).
REPLAY_NOTES = ("A replay plays a recording and takes no prompts: start without --replay to type one",
                "A replay takes no prompts: start without --replay", "A replay takes no prompts")
NEWLINE_MARK = "\u23ce"  # ⏎: a line break in the one-line prompt field (sent as "\n")
TAB_MARK = "\u21e5"  # ⇥: a kept tab as a field shows it, one cell wide (sent as "\t"; as visible_piece shows one)
# An escape sequence as a terminal would act on it, dropped whole from a paste: CSI (ESC [ ... final
# byte, e.g. ESC[31m), OSC (ESC ] ... BEL or ESC \\), or ESC and one character; a lone ESC at the end too.
_ESCAPE_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[ -~])?|\x9b[0-?]*[ -/]*[@-~]")
PRIORITY_LIMIT = PRIORITY_MAX  # the engine's bound, shared by every entry point: -1000 to 1000
ONE_LINE_WIDTH = 80  # narrower terminals put the settings under the prompt (the app's Screen class -cramped)


def pasted_text(text: str) -> tuple[str, int]:
    """A paste as the prompt field holds it, and how many characters were dropped from it.

    ``"a\\r\\nb\\x1b[31mc"`` -> ``("a⏎bc", 5)``: line breaks (``\\n``, ``\\r\\n``, ``\\r``) become
    ``NEWLINE_MARK``, a tab is kept, escape sequences (whole) and every other control character
    (Unicode category Cc) are dropped. Never raises."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    kept = _ESCAPE_SEQUENCE.sub("", text)
    kept = "".join(c for c in kept if c in "\n\t" or unicodedata.category(c) != "Cc")
    return kept.replace("\n", NEWLINE_MARK), len(text) - len(kept)


def prompt_from_bar(value: str) -> str:
    """The prompt the field's ``value`` sends: every ``NEWLINE_MARK`` a newline (``"a⏎b"`` -> ``"a\\nb"``)."""
    return value.replace(NEWLINE_MARK, "\n")


def bar_from_prompt(prompt: str) -> str:
    """What the field shows for a sent ``prompt`` put back in it (a refused one): the inverse of
    :func:`prompt_from_bar` (``"a\\r\\nb"`` -> ``"a⏎b"``)."""
    return prompt.replace("\r\n", "\n").replace("\r", "\n").replace("\n", NEWLINE_MARK)


@dataclass
class PromptSettings:
    """What the prompt bar sends with a prompt: priority (higher runs first), max tokens, temperature
    (0 = greedy), and chat (True: as a user message through the chat template; False: raw text;
    None: chat when the model has a chat template, decided when it has loaded)."""

    priority: int = 0
    max_tokens: int = 50
    temperature: float = 0.0
    chat: bool | None = None
    # max_tokens was typed (--max-tokens): kept even when the engine's max_model_len refuses it; the
    # default is lowered to fit instead (trial 30e)
    max_tokens_given: bool = True


def fitting_max_tokens(limit: int) -> int:
    """The max tokens an untyped default becomes when the engine's ``max_model_len`` (``limit``) refuses it:
    half the context, room left for a prompt (the bar at attach, the command line at parse)."""
    return max(1, limit // 2)


# One rule for the three settings: ASCII digits only (int() and float() also take '٥', '1_0', 'inf'
# and 'nan', issue 29), spaces around the value ignored, and an empty field refused like any wrong
# value (there is no hidden default: the field shows what is sent).
_WHOLE, _DECIMAL = cli_args.WHOLE, cli_args.DECIMAL  # the command line's own patterns: one rule


def _whole(text: str) -> int:
    if not _WHOLE.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text.strip())


def parse_priority(text: str) -> int:
    """``"3"`` -> 3. Raises ValueError: empty, not a whole number in ASCII digits, or beyond +-PRIORITY_LIMIT."""
    value = _whole(text)
    if abs(value) > PRIORITY_LIMIT:
        raise ValueError(text)
    return value


def parse_temperature(text: str) -> float:
    """``"0.7"`` -> 0.7 (0: greedy). Raises ValueError: empty, not a decimal number in ASCII digits
    (``inf``, ``nan`` included), below 0, or above float32's largest, the engine's own bound
    (``SamplingParams``; trial 39a: ``1e308`` passed here and the engine refused it after Enter)."""
    if not _DECIMAL.fullmatch(text.strip()):
        raise ValueError(text)
    value = float(text.strip())
    if not 0 <= value <= FLOAT32_MAX:  # 1e999 overflows to inf
        raise ValueError(text)
    return value


def max_tokens_parser(limit: int | None) -> Callable[[str], int]:
    """A parser of max tokens: a whole number in ASCII digits from 1 to ``limit`` (the model's
    max_model_len; None: no limit yet). Raises ValueError otherwise (empty included)."""

    def parse(text: str) -> int:
        value = _whole(text)
        if value < 1 or (limit is not None and value > limit):
            raise ValueError(text)
        return value

    return parse


class Setting(Validator):
    """A prompt-bar field's rule: ``parse`` accepts the text or raises ValueError; ``rule`` says what is wanted."""

    def __init__(self, name: str, parse: Callable[[str], object], rule: str) -> None:
        super().__init__()
        self.name, self.parse, self.rule = name, parse, rule

    def validate(self, value: str) -> ValidationResult:
        try:
            self.parse(value)
        except (ValueError, OverflowError):
            return self.failure(f"{self.name} must be {self.rule}, not {quoted(value.strip())}")
        return self.success()


def priority_parser(policy: str | None) -> Callable[[str], int]:
    """A parser of the priority field under the engine's scheduling ``policy`` (None: not known yet):
    :func:`parse_priority`, then the engine's rule (``check_priority``: under ``fcfs`` 0 only, as vLLM).
    Raises ValueError otherwise."""

    def parse(text: str) -> int:
        return check_priority(parse_priority(text), policy=policy)

    return parse


def setting_rules(limit: int | None = None, policy: str | None = None) -> dict[str, Setting]:
    """The three settings' rules by field id; ``limit``: the model's max_model_len, ``policy``: the
    engine's scheduling policy (None: not known yet)."""
    max_rule = f"a whole number from 1 to {limit} (the max_model_len of the engine it goes to: here or the server's)" if limit else "a whole number >= 1"
    priority_rule = (f"a whole number from -{PRIORITY_LIMIT} to {PRIORITY_LIMIT} (higher runs first; vLLM's "
                     "priority is the opposite)")
    if policy == "fcfs":  # trial 12: accepted and ignored; vLLM refuses it ("Priority scheduling is not enabled")
        priority_rule = ("0 while the engine schedules fcfs (arrival order, priorities unused, as in vLLM; "
                         "start it with --scheduling-policy priority to use them)")
    return {
        "priority": Setting("priority", priority_parser(policy), priority_rule),
        "max-tokens": Setting("max tokens", max_tokens_parser(limit), max_rule),
        "temperature": Setting("temperature", parse_temperature, f"a number from 0 (greedy) to {FLOAT32_MAX:.3g}, float32's largest"),
    }


def settings_errors(settings: PromptSettings, priorities: Sequence[int] = (),
                    limit: int | None = None) -> list[tuple[str, str]]:
    """(field id, why) for each of ``settings`` (and ``priorities``) the bar would refuse, checked by the
    bar's own rules on the text the bar would show: ``nanovllm-tui``'s start-up values, checked before
    anything is sent (and max tokens again once the model's ``limit`` is known)."""
    rules = setting_rules(limit)
    texts = [("max-tokens", str(settings.max_tokens)), ("temperature", repr(float(settings.temperature))),
             ("priority", str(settings.priority))] + [("priority", str(p)) for p in priorities]
    why = []
    for name, text in texts:
        result = rules[name].validate(text)
        if not result.is_valid:
            why.append((name, result.failure_descriptions[0]))
    return why


# The app's keys that are characters: in a field they type themselves (the app's `/` still goes to
# the prompt from a setting or the chat box), so the footer leaves them out there: it offered
# "/ Prompt" while `/` typed a slash into the prompt (trial 10).
TYPED_APP_KEYS = ("space", "n", "a", "q", "left_square_bracket", "right_square_bracket")


def typed_keys(*keys: str) -> list[Binding]:
    """Hidden bindings that shadow the app's bindings of ``keys`` in the footer while a field has the
    focus. They never run: the app types the character (or refuses it in the chat box) first."""
    return [Binding(key, "typed", show=False) for key in keys]


class Field(Input):
    """A prompt-bar field: Enter asks the bar to send, there and then; a paste keeps all its lines
    (:func:`pasted_text`); a tab in the value is shown as one dim ``TAB_MARK`` cell.

    Why the tab mark: Textual's ``Input`` (8.2) measures a tab three ways: 0 cells for the scroll
    width (``rich.cells.cell_len``), 4 for the cursor (``expand_tabs_inline(..., 4)``) and up to 8 as
    drawn (Rich expands tabs to 8). With tabs in the value, End could not scroll to the end: a
    40-tab prompt's last 200 cells could be neither seen nor edited (trial 14a). One cell each way
    makes the three measures the same; the value (what is sent) keeps the real tab."""

    # Enter typed before the app took the terminal (while it starts) reaches it as a line feed, ctrl+j: the
    # terminal's cooked mode turned the Enter into one (trials 42e, 46e: the prompt arrived, its Enter did not)
    BINDINGS = [*typed_keys(*TYPED_APP_KEYS), Binding("ctrl+j", "submit", "Submit", show=False)]

    @property
    def _value(self) -> Text:
        """The value as drawn: each tab as one dim ``TAB_MARK`` (Input's own measures follow this)."""
        text = Text(self.value.replace("\t", TAB_MARK), no_wrap=True, overflow="ignore", end="")
        for index, char in enumerate(self.value):
            if char == "\t":
                text.stylize("dim", index, index + 1)
        return text

    def _position_to_cell(self, position: int) -> int:
        """The cell where character ``position`` is drawn, a tab one cell (see the class docstring)."""
        return cell_len(self.value[:position].replace("\t", TAB_MARK))

    def _cell_offset_to_index(self, offset: int) -> int:
        """The character drawn at cell ``offset`` of the view (a click), a tab one cell."""
        offset += self.scroll_offset.x
        cell = 0
        for index, char in enumerate(self.value.replace("\t", TAB_MARK)):
            width = get_character_cell_size(char)
            if cell <= offset < cell + width:
                return index
            cell += width
        return max(0, min(offset, len(self.value)))

    def action_typed(self) -> None:
        """Nothing: see :func:`typed_keys`."""

    HIDDEN_MARK = "\u2026"  # …: a setting's edge cell when text is hidden past it

    def render_line(self, y: int) -> Strip:
        """Input's line; in a setting (7 cells), ``HIDDEN_MARK`` in the edge cell past which text is
        hidden: a focused 7-character value scrolls one cell for the cursor, and ``---5000`` showed
        as ``--5000`` while the line under the bar said ``'---5000'`` (trial 21d)."""
        strip = super().render_line(y)
        if y != 0 or not self.value or not self.has_class("setting"):
            return strip
        width = self.scrollable_content_region.width
        left = self.scroll_offset.x
        drawn = self._value.cell_len + (1 if self.has_focus and self.cursor_at_end else 0)  # the cursor's cell
        if strip.cell_length > width:  # Input draws one cell more, into the right padding (if any): text
            # there is past the view the cursor scrolls in, so it is a blank here and hidden text is marked
            strip = Strip.join([strip.crop(0, width), Strip([Segment(" " * (strip.cell_length - width),
                                                                     self.rich_style)])])
        for cell, hidden in ((0, left > 0), (width - 1, drawn > left + width)):  # cells of the content line
            if hidden and 0 <= cell < strip.cell_length:
                style = next((seg.style for seg in strip.crop(cell, cell + 1) if seg.text), None)
                strip = Strip.join([strip.crop(0, cell), Strip([Segment(self.HIDDEN_MARK, style)]),
                                    strip.crop(cell + 1, strip.cell_length)])
        return strip

    # Entering a field: a setting selects its value (typing replaces it, as a form's field does on
    # Tab); the prompt puts the cursor after its text (typing continues it). Input applies its
    # select-on-focus when its Focus message is handled, but the app types each key into the
    # focused field at once, in order (``NanoVLLMApp._handle_now``): keys typed right after `/` or
    # Tab went in before that message, were then selected, and the next key replaced them ("Tell
    # me" became "me"), and `/` then typing replaced a prompt put back after a refusal (trial 20e).
    # So the app settles a field's entry before it types into it, and the Focus message, coming
    # after, does not do it again. (Input's own select-on-focus is off: settle_entry does it.)
    _entry_settled = False
    SELECT_ON_ENTRY = True  # a setting: entering selects its value; the prompt (PromptField): cursor to its end

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("select_on_focus", False)
        super().__init__(*args, **kwargs)

    def settle_entry(self) -> None:
        """Apply what entering this field does (select a setting's value, or put the prompt's cursor
        at its end), once per entry: the app calls it before it types the first key into the field;
        Input's own handling of the Focus message does it otherwise."""
        if self._entry_settled:
            return
        self._entry_settled = True
        if self.SELECT_ON_ENTRY:
            self.selection = Selection(0, len(self.value))
        else:
            self.cursor_position = len(self.value)

    def _on_focus(self, event: events.Focus) -> None:
        settled = self._entry_settled
        super()._on_focus(event)
        if not settled and not event.from_app_focus:
            self.settle_entry()
        self._entry_settled = True  # (a focus given back to the app window keeps the cursor where it was)

    def on_blur(self) -> None:
        """The next entry settles afresh; a setting shows its value's start once the focus leaves
        (typing left the view at its end: a cut "prio -1000" read "prio 000")."""
        self._entry_settled = False
        if self.has_class("setting"):
            self.cursor_position = 0
        for bar in self.ancestors:
            if isinstance(bar, PromptBar):
                bar.field_left(self.id)

    async def action_submit(self) -> None:
        self.query_ancestor(PromptBar).submit(self)

    def paste(self, text: str) -> None:
        """Insert a paste at the cursor (over the selection), its line breaks shown as ``⏎``; a toast
        says how many control characters were dropped from it, if any."""
        kept, dropped = pasted_text(text)
        if dropped:
            self.notify(f"{dropped} character{'s' if dropped > 1 else ''} of control codes (escape sequences and "
                        "the like) dropped from the paste; the rest is in the bar.", severity="warning", markup=False)
        if self.selection.is_empty:
            self.insert_text_at_cursor(kept)
        else:
            self.replace(kept, *self.selection)
        self.scroll_to_cursor()

    def scroll_to_cursor(self) -> None:
        """Scroll the view to the cursor. Input does so on each move but one: the field's first value
        ever (Textual takes it for the value it was built with, shown from its start), so a first
        paste left the cursor past the right edge, and End, already there, did not move the view."""
        self.scroll_to_region(Region(self._cursor_offset, 0, width=1, height=1), force=True, animate=False)

    def _on_paste(self, event) -> None:  # Textual's own path (the app hands pastes to paste() itself)
        if event.text:
            self.paste(event.text)
        event.stop()


class PromptField(Field):
    """The prompt's own field: `/` types a slash here, so the footer does not offer "/ Prompt" either."""

    BINDINGS = typed_keys("slash")
    SELECT_ON_ENTRY = False  # entering the prompt continues it (Field.settle_entry)


class ChatBox(Checkbox):
    """The chat box, readable without colour: ``▐X▌ chat`` when prompts go as chat, ``▐ ▌ raw`` when
    they go as raw text (Textual's checkbox shows its X both ways and tells them apart by colour
    only: a text capture read ``▐X▌ chat`` after ctrl+t had turned chat off; issue 29, trial 7)."""

    LABELS = {True: "chat", False: "raw"}
    BINDINGS = typed_keys(*(k for k in TYPED_APP_KEYS if k != "space"))  # space toggles the box (Checkbox's own)

    def action_typed(self) -> None:
        """Nothing: see :func:`typed_keys` (the app refuses a character typed here with a toast)."""

    def __init__(self, value: bool, **kwargs) -> None:
        super().__init__(self.LABELS[bool(value)], value, **kwargs)

    @property
    def BUTTON_INNER(self) -> str:  # noqa: N802 (Textual's class attribute, read per render)
        return "X" if self.value else " "

    def watch_value(self) -> None:
        super().watch_value()
        self.label = self.LABELS[bool(self.value)]

    def get_content_width(self, container, viewport) -> int:
        """The width of ``▐X▌ chat`` either way: the prompt beside it keeps its width on a toggle."""
        return 3 + 2 + max(len(label) for label in self.LABELS.values())


class PromptBar(Vertical):
    """``prompt ▏ prio ▏ max ▏ temp``: Enter in any field sends, Tab moves between fields, Esc leaves.

    Args:
        settings: the fields' starting values.
        send: ``send(prompt, settings)`` sends a prompt and returns its request id, or None if it
            was not sent (the app has said why); called while Enter is handled.
        resized: called after the bar's size changed (the terminal's size, or the red line under
            it came or went), so the app can keep toasts clear of it.

    An empty prompt, or a setting that is wrong, sends nothing and keeps what was typed: the field
    is marked and the reason shown under the bar (an empty prompt's once Enter found it empty, until
    it has text).
    """

    # Tab and shift+Tab go round the bar's own fields (trial 37a: a Tab past the chat box left the bar, and an
    # Enter typed next sent nothing and said nothing); Esc is the way out, as the footer says
    BINDINGS = [Binding("escape", "app.focus_view", "Leave prompt"),
                Binding("tab", "cycle(1)", "Next field", show=False),
                Binding("shift+tab", "cycle(-1)", "Previous field", show=False)]
    ORDER = ("prompt", "priority", "max-tokens", "temperature", "chat")  # the order they stand in
    CHAT_TOOLTIP = ("X chat: the prompt is sent as a user's message through the model's chat template "
                    "(instruction-tuned models answer it). raw: sent as raw text to continue. ctrl+t toggles.")
    FIELDS = ("priority", "max-tokens", "temperature")
    LABELS = {"priority": "prio", "max-tokens": "max", "temperature": "temp"}  # as the bar labels them

    def __init__(self, settings: PromptSettings | None = None,
                 send: Callable[[str, PromptSettings], str | None] | None = None,
                 resized: Callable[[], None] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.resized = resized or (lambda: None)
        self.defaults = settings or PromptSettings()
        self.chat_chosen = False  # the person toggled chat: the model's default no longer applies
        self.send = send or (lambda prompt, settings: None)
        self.rules = setting_rules()
        self._refusals: dict[str, str] = {}  # field id -> the "Not sent: ..." toast naming it, while on screen
        self._empty_refused = False  # Enter found the prompt empty: said under the bar until it has text
        self._moved_to: str | None = None  # the wrong setting (or "prompt") a refused Enter put the cursor in

    def compose(self) -> ComposeResult:
        d = self.defaults
        with Horizontal(id="prompt-fields"):
            yield PromptField(placeholder=PLACEHOLDERS[0], id="prompt")
            with Horizontal(id="prompt-settings"):
                for name, label, value in (("priority", "prio", d.priority), ("max-tokens", "max", d.max_tokens),
                                           ("temperature", "temp", d.temperature)):
                    yield Label(label, classes="setting-label")
                    yield Field(str(value), id=name, classes="setting", validators=[self.rules[name]])
                yield ChatBox(d.chat is not False, id="chat", compact=True, tooltip=self.CHAT_TOOLTIP)
        yield Label(id="prompt-error")
        yield Label(id="prompt-replay")

    def on_mount(self) -> None:
        self._show_errors()

    def on_resize(self) -> None:
        self.resized()
        if self.has_class("-replay"):
            width = self.content_region.width - 2  # the label's padding
            self.query_one("#prompt-replay", Label).update(next((n for n in REPLAY_NOTES if len(n) <= width),
                                                                REPLAY_NOTES[-1]))
            return
        field = self.query_one("#prompt", Input)
        width = field.content_region.width
        field.placeholder = next((p for p in PLACEHOLDERS if len(p) < width), PLACEHOLDERS[-1])

    @property
    def replay(self) -> bool:
        """True once :meth:`for_replay` has turned the bar into its one line."""
        return self.has_class("-replay")

    def for_replay(self) -> None:
        """A replay takes no prompts: the fields are disabled and hidden (nothing can be typed or
        sent), and one line says why in their place."""
        self.add_class("-replay")
        self.query_one("#prompt-fields").disabled = True
        self.on_resize()

    def action_cycle(self, step: int) -> None:
        """Move the focus ``step`` fields on (1: Tab, -1: shift+Tab) in :attr:`ORDER`, round from the chat box
        to the prompt and back."""
        focused = self.app.focused
        here = next((i for i, name in enumerate(self.ORDER) if focused is not None and focused.id == name), -1)
        # at once, as Textual's own focus_next: keys queued behind the Tab go to the field it moved to (trial 20e)
        self.screen.set_focus(self.query_one(f"#{self.ORDER[(here + step) % len(self.ORDER)]}"))

    def focus_prompt(self) -> bool:
        """Move the focus to the prompt field; False (focus unchanged) in a replay, which has none."""
        if self.replay:
            return False
        self.screen.set_focus(self.query_one("#prompt", Input))
        return True

    @property
    def chat(self) -> bool:
        """True while prompts are sent as chat (the box is ticked)."""
        return self.query_one("#chat", Checkbox).value

    def toggle_chat(self) -> None:
        self.chat_chosen = True
        box = self.query_one("#chat", Checkbox)
        box.value = not box.value

    def model_has_chat_template(self, has: bool) -> None:
        """The model is known: unless chat was chosen (``--chat`` or a toggle), send chat exactly
        when it has a chat template."""
        if self.defaults.chat is None and not self.chat_chosen:
            self.query_one("#chat", Checkbox).value = has

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        if event.checkbox.id == "chat" and event.checkbox.has_focus:  # a click or space, not the model's default
            self.chat_chosen = True

    def use_policy(self, policy: str | None) -> None:
        """The engine is known: its scheduling ``policy`` decides which priorities it takes (``fcfs``: 0 only)."""
        self.rules["priority"] = setting_rules(policy=policy)["priority"]
        field = self.query_one("#priority", Input)
        field.validate(field.value)
        self._show_errors()

    def limit_max_tokens(self, limit: int) -> int | None:
        """The model is known: max tokens may not exceed its ``max_model_len`` (``limit`` tokens).

        A default nobody typed (no ``--max-tokens``, the field untouched) that exceeds it is lowered to
        half of it, room left for a prompt, rather than refused before anything was typed (trial 30e: an
        app attached to a server with ``--max-model-len 24`` opened with its own 50 in red). Returns the
        new value when it lowered it, else None."""
        self.rules["max-tokens"] = setting_rules(limit)["max-tokens"]
        field = self.query_one("#max-tokens", Input)
        lowered = None
        if (not self.defaults.max_tokens_given and field.value.strip() == str(self.defaults.max_tokens)
                and self.defaults.max_tokens > limit):
            lowered = fitting_max_tokens(limit)
            field.value = str(lowered)
        field.validate(field.value)
        self._show_errors()
        return lowered

    def errors(self) -> list[tuple[str, str]]:
        """(field id, why) for every setting that is wrong now."""
        wrong = []
        for name in self.FIELDS:
            field = self.query_one(f"#{name}", Input)
            result = self.rules[name].validate(field.value)
            if not result.is_valid:
                wrong.append((name, result.failure_descriptions[0]))
        return wrong

    def read_settings(self) -> PromptSettings | None:
        """The settings as typed, or None when one is wrong (see :meth:`errors`)."""
        if self.errors():
            return None
        value = {name: self.query_one(f"#{name}", Input).value for name in self.FIELDS}
        return PromptSettings(self.rules["priority"].parse(value["priority"]), self.rules["max-tokens"].parse(value["max-tokens"]),
                              parse_temperature(value["temperature"]), chat=self.chat)

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id in self.FIELDS:
            self._show_errors()
        elif event.input.id == "prompt" and self._empty_refused and prompt_from_bar(event.value):
            self._empty_refused = False  # the reason under the bar goes once there is something to send
            self._show_errors()

    def _show_errors(self) -> None:
        """Mark the wrong settings and give each reason under the bar; an empty prompt that Enter
        refused is said there too, until it has text (trial 20a: it was only a toast)."""
        wrong = self.errors()
        for name in self.FIELDS:
            self.query_one(f"#{name}", Input).set_class(name in dict(wrong), "-invalid")
        self.query_one("#prompt", Input).set_class(self._empty_refused, "-invalid")
        if self._empty_refused:
            wrong.insert(0, ("prompt", EMPTY_PROMPT))
        if self._moved_to not in dict(wrong):
            self._moved_to = None  # fixed: the cursor stays, but there is nothing more to say about it
        self.set_class(bool(wrong), "-invalid")
        reasons = [why for _, why in wrong] + ([self.moved_note(self._moved_to)] if self._moved_to else [])
        self.query_one("#prompt-error", Label).update(Text("; ".join(reasons)))  # typed text: no markup
        withdraw = getattr(self.app, "withdraw", None)
        for name in [n for n in self._refusals if n not in dict(wrong)]:
            message = self._refusals.pop(name)
            if withdraw is not None:
                withdraw(message)

    def moved_note(self, name: str) -> str:
        """What a refused Enter did with the focus: it put the cursor in setting ``name`` (its value
        selected, as entering a setting does: Field.settle_entry), where a `/` or a letter typed next,
        meant for the prompt, would otherwise go without a word (trial 21d); or, ``name`` "prompt",
        in the empty prompt, from the setting Enter was pressed in (trial 25b)."""
        if name == "prompt":
            return "the cursor is in the prompt now"
        return f"the cursor is in {self.LABELS[name]} now, its value selected: fix it, then / returns to the prompt"

    def field_left(self, name: str | None) -> None:
        """The focus left field ``name``: the line under the bar no longer says the cursor is there."""
        if name is not None and name == self._moved_to:
            self._moved_to = None
            self._show_errors()

    def put_back(self, prompt: str) -> bool:
        """Put a refused ``prompt`` back in the empty prompt field, line breaks as ``⏎``, the cursor
        after it. False (nothing changed) when the field holds new text."""
        field = self.query_one("#prompt", Input)
        if field.value:
            return False
        field.value = bar_from_prompt(prompt)
        field.cursor_position = len(field.value)  # typing goes on after it, not in front (trial 8)
        field.scroll_to_cursor()
        return True

    def submit(self, field: Input) -> None:
        """Enter in ``field``: send the prompt with the settings, or say why not and keep it."""
        if self.replay:  # the fields are disabled; a key that still got here sends nothing
            return
        prompt_field = self.query_one("#prompt", Input)
        prompt = prompt_from_bar(prompt_field.value)
        wrong = self.errors()
        if not prompt and not wrong:  # only spaces is sent: it tokenizes to tokens, as vLLM takes it (trial 16);
            # the engine refuses a prompt of no tokens with its own reason
            self._empty_refused = True
            # Enter pressed in a setting: the cursor moves to the prompt, and the line under the bar says so
            self._moved_to = None if field is prompt_field else "prompt"
            self._show_errors()  # the reason under the bar, as a wrong setting's (trial 20a)
            message = f"Not sent: {EMPTY_PROMPT}."
            self._refusals["prompt"] = message  # withdrawn once the prompt has text (_show_errors)
            self.notify(message, severity="warning", markup=False)
            self.screen.set_focus(prompt_field)
            return
        if wrong:
            # The cursor goes to the first wrong setting, as a form focuses the field to fix, and the
            # line under the bar and the toast say so (trial 21d: the focus moved without a word), also
            # when the prompt is empty too (trial 25b: the cursor went to the prompt, and the line under
            # the bar said nothing of it; the keys typed next, meant for the setting, went there).
            name, why = wrong[0]
            self._empty_refused = not prompt
            self._moved_to = name
            self._show_errors()
            # (the toast only names the field: at 60x20 a longer one did not fit above the bar)
            label = self.LABELS[name]
            if prompt:
                message = f"Not sent: {why}. The prompt is kept; the cursor is in {label} now."
            else:  # withdrawn once either is fixed: it would no longer be true
                message = f"Not sent: {EMPTY_PROMPT}, and {why}. The cursor is in {label} now."
                self._refusals["prompt"] = message
            self._refusals[name] = message  # withdrawn once that field is right (_show_errors)
            self.notify(message, severity="error", markup=False)
            target = self.query_one(f"#{name}", Input)
            self.screen.set_focus(target)
            # selected as the note says, also when Enter was pressed in that very field (no focus moves,
            # so entering it selects nothing: typing appended, 'abc' + 'QQ'; trial 23a)
            target.selection = Selection(0, len(target.value))
            return
        if self.send(prompt, self.read_settings()) is not None:
            prompt_field.value = ""
            self.screen.set_focus(prompt_field)

"""``nanovllm-tui``: a full-screen window onto a running engine.

The window appears at once; torch and the engine are set up behind it (``BackgroundController``),
the model loads on the engine thread with its progress in the header, and prompts sent
meanwhile wait in the queue. Everything
shown comes from the engine's events, which the :class:`~nanovllm_tui.bridge.EngineBridge`
hands to this (UI) thread at most once a frame; only the visible tab redraws.

Why past ~400 lines: the App class is the one place where keys, commands and the engine's
events meet the tabs; the tabs, widgets, options and lifetime handling each have their own
module, and what stays here is the wiring a reader follows from a key press to the screen.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import time
from typing import Any, Iterable, Sequence

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.geometry import Size
from textual.widgets import ContentSwitcher, Input, TabbedContent, TabPane

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import agree, plural, weights_label
from nanovllm_core.educational.narrator import Narrator
from nanovllm_core.prompts import user_message
from nanovllm_core.sampling_params import SamplingParams, overflow_with_options, pool_with_options
from nanovllm_tui import hints
from nanovllm_tui.bridge import DEFAULT_FPS, EngineBridge
from nanovllm_tui.commands import TABS, EngineCommands, app_bindings
from nanovllm_tui.replay import REPLAY_ABORT_REFUSAL
from nanovllm_tui.state import EngineState
from nanovllm_tui.views.base import EngineView
from nanovllm_tui.views.block_map import BlockMapView
from nanovllm_tui.views.dashboard import DashboardView
from nanovllm_tui.views.narrator import NarratorView
from nanovllm_tui.views.tutorial import TutorialView
from nanovllm_tui.views.xray import XRayView
from nanovllm_tui.widgets.footer import SteadyFooter
from nanovllm_tui.widgets.prompt_bar import (ONE_LINE_WIDTH, REPLAY_NOTES, Field, PromptBar, PromptSettings,
                                             fitting_max_tokens, settings_errors)
from nanovllm_tui.widgets.status_header import StatusHeader

VIEWS: dict[str, type[EngineView]] = {"dashboard": DashboardView, "xray": XRayView, "narrator": NarratorView,
                                      "tutorial": TutorialView, "blocks": BlockMapView}
NARROW, SHORT = 100, 30  # below these sizes panels fold away (see app.tcss)
# Below this many rows the Dashboard's top panels keep 2 rows of text (at 80x24 there is room for 4:
# with 2, the Engine panel's batch and queue lines were cut; the table and the request text keep 4 each).
VERY_SHORT = 24
REPLAY_REFUSAL = REPLAY_NOTES[0] + "."  # the toast when a replay is asked for a prompt
NOT_IN_REPLAY = ("focus_prompt", "toggle_chat", "abort")  # actions a replay cannot carry out
# What each of them would have done, named when its hidden key is pressed in a replay anyway (trial 7:
# every refusal said "takes no prompts", also for keys that are not about prompts).
REPLAY_REFUSALS = {
    "focus_prompt": REPLAY_REFUSAL,
    "toggle_chat": ("No chat/raw switch in a replay: it applies to prompts you send, and a replay plays a "
                    "recording; start without --replay to send one."),
    "abort": ("No abort in a replay: its requests are recorded and run as they ran; start without --replay to "
              "abort a request of your own."),
}
# The controllers' commands: an EngineError "<command>: why" (no step) is that command refused.
COMMANDS = ("submit", "pause", "resume", "step", "abort", "xray", "call", "snapshot")


class Tabs(TabbedContent):
    """The five tabs. Only a key (or a click on a tab's title) changes the visible tab.

    Textual's ``TabbedContent`` also switches to any pane in which a widget takes the focus.
    The app moves the focus into the tab a key shows, so under load the focus event of an
    earlier tab key could arrive after a later key and switch back (issue 15: ``1 2 3 4 5``
    ended on 3, or hopped between tabs for seconds with no key pressed).
    """

    BLANK = True  # see Pane

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.stop()
        event.prevent_default()  # TabbedContent's own handler would make the focused pane active

    def on_mount(self) -> None:
        self.query_one(ContentSwitcher).BLANK = True  # made by TabbedContent; see Pane

    def _watch_active(self, active: str) -> None:  # a key (``action_show_tab``) or code sets ``active``
        settle_layout_baseline(self.screen)
        super()._watch_active(active)

    def _on_tabs_tab_activated(self, event) -> None:  # a click on a tab's title
        settle_layout_baseline(self.screen)
        super()._on_tabs_tab_activated(event)


def abort_progress(event: ev.RequestFinished, row: Any) -> str:
    """What an aborted request had done and what its abort did to the pool, for the toast: "after 2 tokens; its
    KV blocks are released ...", and for one with no token yet, how far its prefill got from its row
    (``RequestView.prefilled``, as the table shows it; trial 43e: "after 0 tokens" for a prompt 48 of 72 in)."""
    released = "its KV blocks are released (a block another request shares stays in use)"
    total = getattr(row, "prompt_len", None)
    if event.num_output_tokens or total is None:
        return f"after {plural(event.num_output_tokens, 'token')}; {released}"
    done = row.prefilled
    if not done and getattr(row, "num_preemptions", 0):  # preempted in its prefill, not readmitted since
        return "while preempted; it held no KV blocks (its preemption had released them)"
    if not done:  # waiting: it held no K/V of its own
        return "before its prefill began; it held no KV blocks"
    return f"in the middle of its prefill, {done} of its {total} prompt tokens in the KV cache; {released}"


def settle_layout_baseline(screen: Any) -> None:
    """Bring the screen compositor's record of laid-out widgets up to date before a tab's pane is shown.

    Textual (8.2) sends a widget its first ``Resize`` and ``Show`` only when a full layout finds it
    new against that record. A scroll anywhere (PageDown in the X-Ray, the Tutorial's chapter, a
    log's auto-scroll) lays out by a fast path that leaves the record stale and marked so; the next
    lookup of it (a focus change does one) rebuilds it from the widgets displayed *then*, so a pane
    shown in between was in the record before its layout, and its widgets never got those events. A
    ``RichLog`` keeps every write deferred until its first ``Resize``: the Narrator stayed blank
    until a resize or another tab switch (newcomer trial 30a). Rebuilt here, while the old pane is
    still the one displayed, the record holds the old pane, and the new one is found new."""
    compositor = getattr(screen, "_compositor", None)
    if compositor is not None:
        compositor.full_map  # noqa: B018 -- the property rebuilds the record if a scroll marked it stale


class Pane(TabPane):
    """A tab's pane, drawn as blank lines of its background (Textual's ``BLANK``).

    Textual paints every visible widget whole, containers under their children included, and a tab
    switch repaints the containers around the tab: the screen, the tabbed content, its switcher and
    the pane, ~140 lines of background at 120x40. Through the styles cache they took ~15 ms of the
    UI thread's ~70 ms for a key (profiled on a 2-core AMD EPYC while the engine generated, issue
    29 item 10); as ``BLANK`` widgets they cost a blank strip each. A ``BLANK`` widget draws no
    border, padding or content of its own: these containers have none (app.tcss)."""

    BLANK = True


class NanoVLLMApp(App):
    """The app, on a ``controller``: an ``EngineController``, a ``BackgroundController`` (one being
    built behind the window, as ``nanovllm-tui`` does), a ``ReplayController`` or a
    ``RemoteController`` (a running ``nanovllm serve``).

    Args:
        sampling: the base ``SamplingParams`` of prompts sent from the prompt bar (its
            temperature and max tokens are replaced by the bar's).
        settings: the prompt bar's starting priority, max tokens and temperature.
        prompts: (prompt, priority) pairs to send at start.
        fps: most screen updates per second from engine events.
        tutorial_path: where tutorial progress is kept (None: the tutorial module's default).
        recorders: extra subscribers (trace writers) closed when the app quits.
        record_xray: the recorders also get each step's X-Ray ``LayerTrace`` events (``--trace-xray``).
        freeze_gc: keep long-lived objects out of garbage collection (see ``_settle_memory``);
            ``nanovllm-tui`` turns it on.
        narrate_steps: decode steps the narrator tells one by one per request (None: all);
            the rest are summed up when the request finishes.
    """

    CSS_PATH = "app.tcss"
    TITLE = "nano-vLLM"
    COMMANDS = App.COMMANDS | {EngineCommands}
    BINDINGS = app_bindings()

    def __init__(self, controller: Any, *, sampling: SamplingParams | None = None, settings: PromptSettings | None = None,
                 prompts: Iterable[tuple[str, int]] = (), fps: float = DEFAULT_FPS, tutorial_path: Any = None,
                 recorders: Sequence[Any] = (), freeze_gc: bool = False, narrate_steps: int | None = 10,
                 record_xray: bool = False) -> None:
        super().__init__()
        self.freeze_gc = freeze_gc
        self.controller = controller
        self.sampling = sampling or SamplingParams(temperature=0.0)
        self.settings = settings or PromptSettings()
        self._initial_prompts = list(prompts)
        self.tutorial_path = tutorial_path
        self.recorders = list(recorders)
        self.record_xray = record_xray
        self.state = EngineState()
        self.narrator = Narrator(max_decode_steps_per_request=narrate_steps)
        self.bridge = EngineBridge(self, fps=fps)
        self.selected: str | None = None
        # The X-Ray has chosen a request and layer (its tab was opened): from then on a new selection
        # is sent to the engine on any tab, so the traced request follows it (trial 11: it stayed on
        # the request the tab last showed, and --trace-xray recorded no step of the others).
        self._xray_chosen = False
        self._aborted_here: set[str] = set()  # ids this app asked to abort (a toast tells other aborts apart)
        self._shown_tab = "dashboard"
        self._on_screen: dict[tuple[str, str, str], float] = {}  # notifications showing -> until (monotonic s)
        self._flush_pending = False
        self._drained_state: str | None = None  # the controller's state read just before the newest drain
        self._mounted = False
        self._stopped = False
        self.leaving_process = False  # main(): the process ends with the app (stop_engine abandons a step)
        self.exit_lines: list[str] = []  # said on stderr once the app has ended (close_recorders)
        self.recording_failed = False  # a trace file could not be written: the process ends with status 1
        # Prompts sent from the bar that the engine has not yet accepted: a refusal puts one back
        # (the bar clears on Enter, and a refusal arrives later), as a bad setting keeps it.
        self._unconfirmed: dict[str, str] = {}
        self._startup_ids: dict[str, int] = {}  # request id -> its --prompt's place (1, 2, ...)
        self._startup_waits = False  # --prompt under --connect waits for the server's max_model_len (_start)
        self._early_refusals: list[ev.RequestRejected] = []  # theirs, before the model's length was known
        self._narrator_error_shown = False
        self._started = time.monotonic()

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield StatusHeader(id="header")
        with Tabs(initial="dashboard", id="tabs"):
            for i, (tab, title) in enumerate(TABS, 1):
                with Pane(f"{i} {title}", id=tab):
                    yield VIEWS[tab](id=f"{tab}-view")
        yield PromptBar(self.settings, send=self._submit, resized=self._fit_toasts_after_refresh, id="prompt-bar")
        yield SteadyFooter()

    def get_driver_class(self) -> type:
        """Textual's driver, except under textual-serve (``--web``): one that also ends the
        process when its page or the web server goes away (``lifetime.PageWebDriver``)."""
        from textual.drivers.web_driver import WebDriver

        from nanovllm_tui.lifetime import filter_escapes_in_pastes, read_esc_key_as_alt, tolerate_bad_input

        tolerate_bad_input()
        read_esc_key_as_alt()
        filter_escapes_in_pastes()
        driver = super().get_driver_class()
        if driver is WebDriver:
            from nanovllm_tui.lifetime import PageWebDriver

            return PageWebDriver
        return driver

    def on_mount(self) -> None:
        if not self.is_headless:  # a test's app leaves the test runner's signals alone
            from nanovllm_tui.lifetime import quit_on_signals

            quit_on_signals(self)
        # with --trace-xray the recorder gets every step's traces; the views get them too, so the X-Ray
        # opened later shows the newest (trial 29c: an attached app's stream carries only what a
        # subscriber asked for, and the tab said "No trace yet" beside a file holding them)
        # (block snapshots too while --trace records them: the Narrator's KV entries of the steps recorded)
        self.bridge.connect(self.controller, topk=5, xray=self.record_xray, blocks=bool(self.recorders))
        if self.live and getattr(self.controller, "start_paused", False) is True and not self.state.ready:
            # --paused: the loading header says "will start paused" from its first frame, and space or n
            # act on that intent (trial 11: the header said nothing, n said "press space to pause first",
            # and a second space undid --paused)
            self.state.paused = True
        for recorder in self.recorders:
            self.controller.subscribe(recorder, topk=5, blocks=True, xray=self.record_xray)
        self.screen.BLANK = True  # the main screen: its background only, as Pane says
        self.query_one("#tabs ContentTabs").can_focus = False  # 1-5 switch tabs; Tab moves between views and prompt
        self._adapt_to_size()
        if not self.live:
            self.query_one(PromptBar).for_replay()
        if not self.query_one(PromptBar).focus_prompt():  # a replay: the keys go to the Dashboard's table
            self.call_after_refresh(self.action_focus_view)
        self.call_after_refresh(self._start)

    def _start(self) -> None:
        """After the first paint, when every tab's widgets exist: take the events that waited in
        the bridge, send the prompts given at start, and let a waiting engine start."""
        self._mounted = True
        self._sync_paused()
        cut = getattr(self.controller, "cut_line", None)
        if cut:  # a note, not an error: what came before the cut plays as recorded
            self.notify(f"The recording ends in a cut line (line {cut} is not a whole event, as when a trace is "
                        f"copied while it is written): it plays up to line {cut - 1}.", timeout=10, markup=False)
        cut_step = getattr(self.controller, "cut_step", None)
        if cut_step is not None:  # the step had no StepTimed: it never finished, so it is not shown as if it had run
            self.notify(f"The recording stopped during step {cut_step}, before it finished: that step is not "
                        "played (the replay ends with the step before it).", timeout=10, markup=False)
        self.set_interval(0.5, self._poll_engine_state)
        if (self._initial_prompts and not self.settings.max_tokens_given and self.live
                and not getattr(self.controller, "local_engine", True)
                and not self.state.model_info.get("max_model_len")):
            # --connect with the default max tokens nobody typed: the server's max_model_len decides what it
            # becomes (half of it where it does not fit, as in the bar), so the prompts go once the server
            # has told it; sent now with the default, they ended the app with the --max-tokens line
            self._startup_waits = True
        else:
            self._send_startup_prompts()
        self._take_events()
        self._settle_memory()
        if hasattr(self.controller, "start"):
            self.controller.start()
        # The UI thread keeps the normal priority (issue 29): at nice +10 it had the engine's gaps
        # on an idle host, but on a busy one every other process came first and a tab took seconds.

    def _send_startup_prompts(self) -> None:
        """Send the prompts given at start (``--prompt``) with the settings of the command line; a default max
        tokens nobody typed that the engine's known max_model_len refuses goes as half of it, as the bar's."""
        self._startup_waits = False
        limit = self.state.model_info.get("max_model_len")
        if limit and not self.settings.max_tokens_given and self.settings.max_tokens > limit:
            self.settings = dataclasses.replace(self.settings, max_tokens=fitting_max_tokens(limit))
        for i, (prompt, priority) in enumerate(self._initial_prompts, 1):
            rid = self._submit(prompt, dataclasses.replace(self.settings, priority=priority,
                                                           chat=self.query_one(PromptBar).chat))
            if rid is not None:
                self._startup_ids[rid] = i

    def _settle_memory(self) -> None:
        """With ``freeze_gc``: move what exists now (torch, the model, the tokenizer: ~10^5 objects)
        out of the garbage collector's view. A full collection over them takes a few hundred ms,
        a visible stall of the UI; the app's own short-lived objects are still collected as usual.
        Off by default because frozen objects are never freed (fine for the one app of a process)."""
        if self.freeze_gc:
            gc.freeze()

    @property
    def live(self) -> bool:
        """False when replaying a trace."""
        return getattr(self.controller, "live", True)

    @property
    def active_tab(self) -> str:
        return self.query_one(TabbedContent).active or "dashboard"

    def view(self, tab: str | None = None) -> EngineView:
        return self.query_one(f"#{tab or self.active_tab}-view", EngineView)

    def on_resize(self, event: events.Resize) -> None:
        self._adapt_to_size(event.size)
        if self._mounted:
            self.call_after_refresh(self._show_header)  # at the new width

    def _fit_toasts_after_refresh(self) -> None:
        self.call_after_refresh(self._fit_toasts)

    def _fit_toasts(self, tries: int = 20) -> None:
        """Keep notifications between the tabs and the prompt bar: the toast rack (docked at the
        top, app.tcss) may grow only down to the bar's first row, the red line that says what to
        fix included, and the newest toasts that fit are shown, older ones hidden (Textual's rack
        would scroll, but a rack of hidden visibility is never sized, so it shows the oldest).
        At 60x20 three stacked toasts reached row 25, over the bar, the newest out of sight."""
        from textual.widgets._toast import Toast, ToastRack  # Textual's own: no public names

        if self._stopped or not self.is_running or not self.screen_stack:  # the app is closing
            return
        for rack in self.screen.query(ToastRack):
            room = self.query_one(PromptBar).region.y - rack.styles.margin.top
            rack.styles.max_height = max(room, 1)
            toasts = list(rack.query(Toast))
            if tries and any(not t.outer_size.height and t.parent.display for t in toasts):
                self.set_timer(0.05, lambda: self._fit_toasts(tries - 1))  # a new toast is not laid out yet
                return
            for toast in reversed(toasts):  # newest first
                room -= toast.outer_size.height + toast.styles.margin.top
                toast.parent.display = room >= 0 or toast is toasts[-1]

    def _adapt_to_size(self, size: Size | None = None) -> None:
        width, height = size or self.size
        self.screen.set_class(width < NARROW, "-narrow")
        self.screen.set_class(height < SHORT, "-short")
        self.screen.set_class(height < VERY_SHORT, "-very-short")
        self.screen.set_class(width < ONE_LINE_WIDTH, "-cramped")

    # ------------------------------------------------------------------ engine events

    def on_engine_bridge_events_ready(self, message: EngineBridge.EventsReady) -> None:
        if not self._mounted:  # they wait in the bridge; _start takes them
            return
        delay = self.bridge.delay()
        if delay <= 0:
            self._take_events()
        elif not self._flush_pending:
            self._flush_pending = True
            self.set_timer(delay, self._take_events)

    def _take_events(self, flush: bool = False) -> None:
        """Fold everything the engine sent since the last frame into the state, then redraw
        (``flush``: also the results of a step whose ``StepTimed`` is not coming, see ``EngineBridge``)."""
        self._flush_pending = False
        if not self.is_running:  # a frame timer that fires while the app closes: its widgets are gone
            return
        # Read before the drain: the engine sent every event that led to this state before it set it
        # (see _controller_state), so what is drawn now has them all.
        self._drained_state = self.controller.state
        events = self.bridge.drain(flush=flush)
        known = set(self.state.requests)
        notes = []
        for event in events:
            self.state.apply(event)
            self._announce(event)
            try:
                notes.extend(self.narrator.feed(event))
            except Exception as e:  # commentary is not worth the window: say so, carry on
                self._narrator_failed(event, e)
            if isinstance(event, ev.ModelLoading) and event.ready:
                self._sync_paused()
                self._settle_memory()
                if self.state.model_info.get("max_model_len"):
                    limit = self.state.model_info["max_model_len"]
                    lowered = self.query_one(PromptBar).limit_max_tokens(limit)
                    if lowered is not None:
                        self.notify(f"Max tokens is now {lowered}: the default {self.settings.max_tokens} is more "
                                    f"than this engine's max_model_len ({limit}) allows; half of it leaves room "
                                    "for a prompt. Change it in the prompt bar.", markup=False)
                    if self._startup_waits:
                        self._send_startup_prompts()
                    self._refuse_startup_max_tokens(self.state.model_info["max_model_len"])
                    for early in self._early_refusals:
                        self._refuse_startup_prompt(early)
                    self._early_refusals.clear()
                # the engine's policy decides which priorities it takes (fcfs: 0 only; trial 12)
                self.query_one(PromptBar).use_policy(self.state.model_info.get("scheduling_policy"))
                if "chat_template" in self.state.model_info:  # (traces from before it was recorded lack it)
                    self.query_one(PromptBar).model_has_chat_template(bool(self.state.model_info["chat_template"]))
                self._note_fallbacks(self.state.model_info)
        if notes:
            self.query_one(NarratorView).add(notes)
        if self.selected not in self.state.requests and self.state.requests:
            self.select(self._default_selection())
        elif not self._follow_new_request(known):  # (selecting redraws)
            self._redraw()

    def _follow_new_request(self, known: set[str]) -> bool:
        """A request that appeared in these events (another client's, under ``--connect``) is selected
        when the selected one has finished: the X-Ray said "No trace yet" while the server generated
        for it, until ``]`` was pressed (issue 29). A selected live request is kept. True: selected."""
        current = self.state.requests.get(self.selected) if self.selected else None
        if current is not None and current.live:
            return False
        new = [rid for rid, r in self.state.requests.items() if rid not in known and r.live]
        if not new:
            return False
        self.select(new[-1])
        return True

    def _note_fallbacks(self, info: dict) -> None:
        """Say once, at load, when the engine's C paths are not in use on the CPU, and why (a run that
        silently fell back would hide why it is slower)."""
        if info.get("device") not in (None, "cpu"):
            return
        for key, what in (("cpu_paged_unavailable", "CPU paged attention kernel not used (K/V gathered for SDPA)"),
                          ("native_ops_unavailable", "RMSNorm and RoPE run as PyTorch ops, not in C"),
                          ("block_native_unavailable", "block-quantized layers run PyTorch's matmul, not C"),
                          ("quantization_note", "weights")):
            if info.get(key):  # auto's choice of float (a safetensors model, say) is news, not a fault
                auto = key == "quantization_note" and str(info[key]).startswith("auto chose")
                self.notify(f"{what}: {info[key]}", severity="information" if auto else "warning", timeout=8,
                            markup=False)

    def notify(self, message: str, *, title: str = "", severity: str = "information", timeout: float | None = None,
               markup: bool = True) -> None:
        """Show a notification, unless the same one is still on screen: a held key (``n`` while
        running repeats a dozen times a second) says its warning once. The toasts are then fitted
        above the prompt bar (:meth:`_fit_toasts`)."""
        now = time.monotonic()
        key = (message, title, severity)
        if self._on_screen.get(key, 0.0) > now:
            return
        timeout = self.NOTIFICATION_TIMEOUT if timeout is None else timeout
        self._on_screen = {k: until for k, until in self._on_screen.items() if until > now}
        self._on_screen[key] = now + timeout
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)
        if self._mounted:  # the rack mounts the toast a refresh or two later
            self.set_timer(0.1, self._fit_toasts)

    def withdraw(self, message: str) -> None:
        """Take a notification off the screen before its time, once what it says is no longer true (a
        prompt-bar setting it named was fixed; trial 13: "Not sent: max tokens ..." stayed after), and
        let the same one show again at once."""
        self._on_screen = {k: until for k, until in self._on_screen.items() if k[0] != message}
        stale = [n for n in self._notifications if n.message == message]
        for n in stale:
            self._unnotify(n, refresh=False)
        if stale:
            self._refresh_notifications()

    def _narrator_failed(self, event: ev.Event, error: Exception) -> None:
        if not self._narrator_error_shown:
            self._narrator_error_shown = True
            self.notify(f"The narrator could not describe a {event.kind} event ({type(error).__name__}: {error}); "
                        "the other tabs are unaffected.", severity="warning", timeout=10, markup=False)

    def _default_selection(self) -> str:
        """With nothing (or a request no longer shown) selected: the newest live request, else the newest."""
        live = [r.request_id for r in self.state.requests.values() if r.live]
        return live[-1] if live else self.state.request_ids()[-1]

    def _announce(self, event: ev.Event) -> None:
        """Notifications for what a person must not miss: refusals, errors, the model becoming ready."""
        if isinstance(event, ev.RequestAdded):
            self._unconfirmed.pop(event.request_id, None)
        elif isinstance(event, ev.RequestRejected) and self._refuse_startup_prompt(event):
            return
        elif isinstance(event, ev.RequestRejected):
            kept = ""
            prompt = self._unconfirmed.pop(event.request_id, None)
            if prompt is not None:
                if self.query_one("#prompt-bar", PromptBar).put_back(prompt):  # line breaks as ⏎ again
                    kept = " (the prompt is back in the bar)"
                else:
                    kept = " (its prompt was not put back: the bar holds new text)"
            self.notify(f"{event.request_id} was rejected: {event.reason}{kept}", severity="error", timeout=8,
                        markup=False)
        elif isinstance(event, ev.EngineError):
            if event.step is None and event.message.startswith(ev.SETTING_REFUSED + ": "):
                # the model is fine: the message names the option to change (trial 12: a huge --block-size
                # was answered with "Start again with --model naming a checkpoint that loads")
                self.notify(f"{event.message}. Start again with that option changed, or --replay FILE.jsonl to "
                            "watch a recording.", title="Engine setting", severity="error", timeout=30, markup=False)
            elif event.step is None and ev.is_load_failure(event.message):
                # (true whether or not --model was given: the app does not know, so it does not say "try --model")
                self.notify(f"{event.message}. Start again with --model naming a checkpoint that loads, or "
                            "--replay FILE.jsonl to watch a recording.",
                            title="No model", severity="error", timeout=30, markup=False)
            elif event.step is None and event.message.partition(":")[0] in COMMANDS:
                # a command refused (by the engine, a server or a replay): not a failure of the engine
                message = event.message
                gone = self.state.requests.get(event.request_id) if event.request_id else None
                if message.startswith("xray:") and gone is not None and gone.state in ("rejected", "lost"):
                    return  # asked while it was being sent, before its rejection came: the X-Ray says why (22b)
                asked = {"pause": "pausing", "resume": "resuming"}.get(event.message.partition(":")[0])
                if asked is not None and self.state.pending == asked:  # the header goes back to what it was
                    self.state.pending = None
                    message += f" (the engine is still {'paused' if self.state.paused else 'running'})"
                if not self.live and not message.endswith(REPLAY_ABORT_REFUSAL):
                    # a refusal the recording app met (trial 38c: its quit's abort, shown as if one failed now)
                    self.notify(f"In the recording: {message}", title="Not done (recorded)", severity="warning",
                                timeout=10, markup=False)
                    return
                self.notify(message, title="Not done", severity="warning", timeout=10, markup=False)
            elif event.step is None and (event.message.startswith("lost the connection")
                                         or "refused the API key" in event.message
                                         or "needs an API key" in event.message):
                # a replay plays what the recording app saw then: said as such, not as this app's connection now
                # (trial 34c: a recording made across a server restart read as losing the connection now)
                self.notify(event.message if self.live else f"In the recording: {event.message}",
                            title="Connection" if self.live else "Connection (recorded)", severity="warning",
                            timeout=10, markup=False)
            else:
                self.notify(event.message, title="Engine error" if self.live else "Engine error (recorded)",
                            severity="error", timeout=10, markup=False)
        elif isinstance(event, ev.RequestFinished) and event.finish_reason == "abort" and self._sent_here(event):
            # only this app's own prompts: an attached server's other clients disconnect all the time,
            # and a toast for each piled up over the panels (issue 29); the table shows their state
            # an abort this app asked for is the person's own; any other came from the server's side (its
            # shutdown, another client's control) and was told in the same words as `a` (trial 26c)
            by = ("" if event.request_id in self._aborted_here else
                  " on the server, not by this app (the server is shutting down, or another client aborted it)")
            self.notify(f"{event.request_id} aborted{by} {abort_progress(event, self.state.requests.get(event.request_id))}",
                        markup=False)
        elif event.kind == "ServerStopped":  # nanovllm_tui.remote's: it stopped before a step's end
            lost = len(event.unfinished)
            self.notify(f"The server at {event.url} stopped while a step ran; {plural(lost, 'request')} it never "
                        f"finished {agree(lost, 'is', 'are')} marked lost.", severity="warning", timeout=10, markup=False)
        elif event.kind == "ServerRestarted":  # nanovllm_tui.remote's: an attached server came back anew
            self.notify(f"The server at {event.url} restarted with a new engine; requests that were running "
                        "there are marked lost, and the ones that had ended are cleared.", severity="warning",
                        timeout=10, markup=False)
            if self.live and self._shown_tab is not None:  # the new engine's detail for the tab shown: a Block Map
                self._set_detail(self._shown_tab)  # open across the restart stayed empty until a step (trial 40c)
        elif isinstance(event, ev.ModelLoading) and event.ready and self.live:
            weights = weights_label(event.info())  # as the header names it: the dtype alone hid GGUF blocks
            self.notify(f"{event.model_name} is ready on {event.device} ({event.dtype}"
                        f"{f' · {weights}' if weights else ''})", markup=False)

    def _sent_here(self, event: ev.RequestFinished) -> bool:
        """The request was sent from this app (its bar or ``--prompt``): only those have ``chat`` known."""
        req = self.state.requests.get(event.request_id)
        return req is not None and req.chat is not None

    def _refuse_startup_prompt(self, event: ev.RequestRejected) -> bool:
        """A ``--prompt`` given at start that the engine (or a server under ``--connect``) refuses, for
        any reason: ``--max-tokens`` does not fit after it in the context, or the KV pool could never
        hold it (``--num-kv-blocks``). The app ends with one line and status 2 naming the first refused
        ``--prompt`` and why, as a wrong option does: the command line is at fault, and a refusal is never
        left half-told (trial 21a: of three refused for a small pool, only the first was put back in the
        bar). A prompt from the bar is put back instead. True: it ends."""
        place = self._startup_ids.get(event.request_id)
        if place is None:
            return False
        if not self.state.model_info.get("max_model_len"):
            # A server's refusal can come before its ready event: once the context length is known,
            # --max-tokens beyond it is refused as such (naming the server's option), else this one
            # (the order of the two once decided which line the app ended with).
            self._early_refusals.append(event)
            return True
        if self.return_code is not None:  # already ending (--max-tokens beyond max_model_len itself): one line
            return True
        which = f"--prompt {place}" if len(self._startup_ids) > 1 else "--prompt"
        # the engine's wording names the fields; the command line's names the options, as nanovllm's does
        # (a server's refusal under --connect is vLLM's wording and is shown as it came)
        reason = pool_with_options(overflow_with_options(event.reason))
        self.exit(return_code=2, message=Text(f"nanovllm-tui: error: {which} was refused: {reason}"))
        return True

    def _refuse_startup_max_tokens(self, limit: int) -> None:
        """The model is known: prompts sent at start (``--prompt``) whose ``--max-tokens`` the bar now
        refuses end the app with one line and status 2, as ``nanovllm --max-tokens`` is refused once
        its model has loaded (they waited in the queue meanwhile; the engine stops with the app)."""
        wrong = settings_errors(self.settings, limit=limit) if self._initial_prompts else []
        if wrong:
            # under --connect the context length is the server's (--connect refuses --max-model-len; trial 6)
            context = self.state.model_info.get("max_position_embeddings")
            if not getattr(self.controller, "local_engine", True):
                fix = "lower --max-tokens or raise `nanovllm serve --max-model-len` on the server"
            elif context is not None and limit >= context:  # raising it is refused at load (trial 20e)
                fix = "lower --max-tokens (--max-model-len is already the model's whole context)"
            else:
                fix = "lower --max-tokens or raise --max-model-len"
            self.exit(return_code=2, message=Text(f"nanovllm-tui: error: --{wrong[0][0]}: {wrong[0][1]}; {fix}"))

    def _controller_state(self) -> str:
        """The controller's state as of the events drawn so far.

        The state is a flag the engine's thread sets as it goes, before the event that tells of it
        (``paused`` before ``EnginePaused``, ``running`` before ``EngineResumed``, a server's or a
        replay's alike) and after the events that led to it (``idle`` after the last step's). Read
        now, it runs ahead of the events still waiting in the bridge: the header said ``paused``
        beside "step 111 running" and rows half of whose tokens were step 111's (trial 16). So while
        any event waits, it is the state read just before the newest drain; with none waiting, the
        state now, every event sent before it having been drawn."""
        now = self.controller.state
        if self.bridge.pending() and self._drained_state is not None:
            return self._drained_state
        return now

    def _sync_paused(self) -> None:
        """A controller started paused says so only through its state (there is no event for it);
        so does one asked to pause (or resume) when it already was: that confirms the request.
        Its state as of the drawn events (``_controller_state``): never ahead of them."""
        now = self._controller_state()
        if now == "paused":
            self.state.paused = True
        if (self.state.pending, now) in (("pausing", "paused"), ("resuming", "running"), ("resuming", "idle")):
            self.state.paused, self.state.pending = now == "paused", None

    def _poll_engine_state(self) -> None:
        """The engine going idle is not an event, nor is time passing while the model loads:
        look at the controller twice a second, and redraw what depends on it (the header, and
        the figures that fall to 0 when the engine stops running)."""
        if not self.is_running:
            return
        if self.state.pending is not None:
            self._sync_paused()
        if self.bridge.stale(2.0):  # a step's results held for a StepTimed that is not coming (a failed device)
            self._take_events(flush=True)
        if not self.live and self.state.unfinished is None and getattr(self.controller, "ended", False):
            self._take_events(flush=True)  # the last step's events first: they are the requests' last word
            self.state.recording_ended()
            self._redraw()
        failed = self.controller.state == "failed" and self.state.load_error is None
        if failed:  # subscribed after the failure was announced: tell it now
            message = getattr(self.controller, "load_failure", None) \
                or f"{ev.MODEL_FAILED}: {self.controller.load_error}"
            failure = ev.EngineError(step=None, message=message)
            self.state.apply(failure)
            self._announce(failure)
        loading = not self.state.ready and self.state.load_error is None
        if failed or loading:
            if self.state.load_error is None:
                self.state.engine_state = self.controller.state
            self._show_header()
        elif self._controller_state() != self.state.engine_state:
            self._redraw()

    def _show_header(self) -> None:
        loading_s = time.monotonic() - self._started if not self.state.ready else None
        self.query_one(StatusHeader).show(self.state, replay=not self.live, loading_s=loading_s,
                                          width=self.size.width - 2)  # the header's padding: one cell a side

    def _redraw(self) -> None:
        if not self._mounted:
            return
        if self.state.load_error is None:
            self.state.engine_state = self._controller_state()
        self._show_header()
        self.view().update_view(self.state, self.selected)

    # ------------------------------------------------------------------ keys

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, (events.Key, events.Paste, events.MouseDown)) and not event.is_forwarded:
            self._yield_for_frame()
            if not self.app_focus and not isinstance(event, events.Paste):
                # What Textual's App.on_event does, which a key handled below never reaches: a key or a
                # click means the terminal has the focus again. Until then Textual's footer ignores
                # binding changes: after a focus-out (tmux sends one) it kept X-Ray's keys on the
                # Narrator (trial 10).
                self.app_focus = True
                self.screen.refresh_bindings()
        if isinstance(event, (events.Key, events.Paste)) and not event.is_forwarded and await self._handle_now(event):
            return
        await super().on_event(event)

    def _yield_for_frame(self) -> None:
        """A person pressed a key or clicked: the local engine waits between layers until the frame
        that answers it is drawn (at most 0.25 s; ``nanovllm_core/yield_gate.py``), so that on a
        busy host the frame does not share the cores with the step's threads (issue 29 item 10)."""
        hold = getattr(self.controller, "yield_for_frame", None)
        if hold is None or not self.live:
            return
        hold()
        self.call_after_refresh(self.controller.frame_drawn)

    async def _handle_now(self, event: events.Key | events.Paste) -> bool:
        """Act on a key (or a paste) at once, in the order they arrive; False: leave it to Textual.

        Textual hands a key to the focused widget's own message queue and runs its binding when
        the key has bubbled back up to the app. Under load, a key that moves the focus (Esc, ``/``,
        1-5, Tab) then acted after the keys behind it had gone to the old widget: keys pressed
        after Esc were typed into the prompt, and a prompt's Enter reached the app after the
        keys that followed it (issue 15). So on the main screen the app runs every key's binding
        itself, and types text (and pastes) into a focused input itself; other screens (the
        command palette) keep Textual's handling.
        """
        if len(self.screen_stack) > 1:
            return False
        focused = self.focused
        in_bar = focused is not None and any(isinstance(node, PromptBar) for node in focused.ancestors)
        if (isinstance(event, events.Key) and event.key.startswith("alt+")
                and event.key not in self.screen.active_bindings):  # alt+backspace (delete a word) stays the field's
            # Esc pressed just before a key reaches Textual as one alt-modified key (ESC 3 -> alt+3; see
            # lifetime.read_esc_key_as_alt): typed "£" or "3" into the prompt instead of leaving the bar
            # and showing tab 3 (issue 29, trial 7), and did nothing outside the bar (trial 8). So: Esc
            # (in the bar: leave it; elsewhere Esc has no binding), then the key's app binding.
            if in_bar:
                self.action_focus_view()
            active = self.screen.active_bindings.get(event.key.removeprefix("alt+"))
            if active is not None and active.enabled:
                await self.run_action(active.binding.action, active.node)
            return True
        if in_bar and isinstance(event, events.Key) and event.is_printable and event.character not in (" ", None):
            if event.key == "slash" and focused.id != "prompt":  # a setting or the chat box: / goes to the prompt
                self.action_focus_prompt()  # (in the prompt itself, / is text, typed below)
                return True
            if not isinstance(focused, Input):  # the chat box: digits typed there switched tabs (issue 29)
                self.notify("The chat box takes space (or ctrl+t) to toggle; Esc leaves the prompt bar "
                            "for the app's keys.", severity="warning", markup=False)
                return True  # a key typed into the bar is never an app key
        if isinstance(focused, Field) and (isinstance(event, events.Paste) or (
                isinstance(event, events.Key) and focused.check_consume_key(event.key, event.character))):
            focused.settle_entry()  # before its Focus message: keys typed right after / or Tab (trial 20e)
        if isinstance(event, events.Paste):
            if isinstance(focused, Field):  # every line kept, as ⏎ (Input keeps the first only: trial 10)
                focused.paste(event.text)
                return True
            text = event.text.splitlines()[0] if event.text else ""  # another input takes one line, as Input does
        elif isinstance(focused, Input) and focused.check_consume_key(event.key, event.character):
            text = event.character
        else:
            active = self.screen.active_bindings.get(event.key)
            if active is None:
                return self._refuse_hidden_key(event.key)
            if not active.enabled:
                return False
            return await self.run_action(active.binding.action, active.node)
        if not isinstance(focused, Input):
            return False
        selection = focused.selection  # what Input does with typed or pasted text
        if selection.is_empty:
            focused.insert_text_at_cursor(text)
        else:
            focused.replace(text, *selection)
        return True

    def _refuse_hidden_key(self, key: str) -> bool:
        """A key whose action is hidden here (a replay's prompt, chat and abort keys, the Tutorial's
        ``r`` in a replay or under --connect): say what was refused and why, instead of nothing.
        True when it was told; False leaves the key to Textual."""
        for node, bindings in self.screen._modal_binding_chain:
            for bound, binding in bindings:
                if bound != key:
                    continue
                action = binding.action.partition("(")[0]
                if node.check_action(action, ()) is not False:
                    continue
                refusal = getattr(node, "refusal", None)
                why = refusal(action) if refusal is not None else None
                if why:
                    self.notify(why, severity="warning", markup=False)
                    return True
        return False

    def refusal(self, action: str) -> str | None:
        """Why the app refuses ``action`` here (see :meth:`check_action`), or None."""
        return REPLAY_REFUSALS.get(action) if action in NOT_IN_REPLAY and not self.live else None

    # ------------------------------------------------------------------ tabs and selection

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """A click on a tab's title (keys show their tab in ``action_show_tab``); stale activations are ignored."""
        tab = event.pane.id
        if not self.is_running:  # one that arrives while the app closes: its widgets are gone
            return
        if tab is not None and tab == self.active_tab and tab != self._shown_tab:
            self._show(tab)

    def _show(self, tab: str) -> None:
        """Draw the tab that has just become visible, ask the engine for its detail, and give it the focus."""
        self._shown_tab = tab
        self._set_detail(tab)
        view = self.view(tab)
        view.update_view(self.state, self.selected)
        if self.focused is None or self.focused.id != "prompt":  # never pull focus out of a half-typed prompt
            view.focus_main()

    def _set_detail(self, tab: str) -> None:
        """Ask the engine for X-Ray traces and block snapshots only while a tab shows them (a tutorial
        demonstration runs on an engine of its own, see ``demo_session.py``)."""
        self.bridge.want(xray=tab == "xray" or self.record_xray,
                         blocks=tab in ("blocks", "narrator") or bool(self.recorders))
        if tab == "xray":
            xray = self.query_one(XRayView)
            self._choose_xray(self.selected, xray.layer_index, xray.head_index)
        if tab == "blocks" and self.live:
            bridge = self.bridge  # a snapshot now, so a paused engine still shows its pool
            self.controller.call(lambda engine: bridge(engine.blocks_event(engine.step_index)))

    def on_xray_view_choice(self, message: XRayView.Choice) -> None:
        self._choose_xray(self.selected, message.layer, message.head)

    def _choose_xray(self, request_id: str | None, layer: int, head: int) -> None:
        """Tell the engine what X-Ray traces. A request lost with a restarted server is not asked
        for by its id (the new server knows none such: a 404 toast beside the tab's own 'lost'
        hint; trial 9), nor is a rejected one (it never existed on the engine: the X-Ray says it was
        rejected): the first request of each step is traced instead."""
        req = self.state.requests.get(request_id) if request_id is not None else None
        if req is not None and req.state in ("lost", "rejected"):  # a rejected one never existed there (trial 22b:
            request_id = None  # a false "the id is wrong ... (HTTP 404)" toast at each selection of it)
        self._xray_chosen = True
        self.controller.xray(request_id, layer, head)

    def select(self, request_id: str | None) -> None:
        if request_id == self.selected:
            return
        self.selected = request_id
        # While the tab is hidden only a recorder (--trace-xray) asks for traces, so a choice costs
        # nothing more; before the tab's first opening the engine traces every layer of each step's
        # first request, as docs/app.md says, and a choice here would cut that to one layer.
        if self.active_tab == "xray" or self._xray_chosen:
            xray = self.query_one(XRayView)
            self._choose_xray(request_id, xray.layer_index, xray.head_index)
        self._redraw()

    # ------------------------------------------------------------------ actions (keys and command palette)

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        if tab != self._shown_tab:
            self._show(tab)

    def action_focus_prompt(self) -> None:
        if not self.query_one(PromptBar).focus_prompt():
            self.notify(REPLAY_REFUSAL, severity="warning", markup=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A replay runs no prompts and cannot change its recorded requests, so it offers no prompt
        key, chat toggle or abort (the footer and the command palette leave them out)."""
        if action in NOT_IN_REPLAY and not self.live:
            return False
        return True

    def action_toggle_chat(self) -> None:
        bar = self.query_one(PromptBar)
        bar.toggle_chat()
        self.notify("Prompts are now sent as chat: a user's message through the model's chat template."
                    if bar.chat else "Prompts are now sent as raw text for the model to continue.", markup=False)

    def action_focus_view(self) -> None:
        self.view().focus_main()

    def action_toggle_pause(self) -> None:
        """Ask the engine (or server, or replay) to pause, or to resume. The header shows the state
        the engine confirmed: ``pausing…`` / ``resuming…`` until its ``EnginePaused`` /
        ``EngineResumed`` arrives (a local engine pauses at its next step boundary), and a refusal
        (a server out of reach or answering an error) is a toast with its reason, the state as it was.
        With no engine (it failed to start) the key says so, as n and a do, rather than nothing."""
        if self.state.no_engine:
            self.notify(self.state.no_engine, severity="warning", markup=False)
            return
        if self.state.pending == "pausing" or (self.state.paused and self.state.pending is None):
            self.state.pending = "resuming"
            self.controller.resume()
        else:
            self.state.pending = "pausing"
            self.controller.pause()
        self._redraw()

    def action_step(self) -> None:
        loading = self.live and not self.state.ready and self.state.load_error is None
        will_pause = hints.steps_on_n(self.state)
        if loading and will_pause and not self.state.active_requests:
            self.notify("The model is still loading: send a prompt; n then runs one step once it has loaded (the "
                        "engine will start paused).", severity="warning")
            return
        if loading and will_pause:  # queued: the engine takes it once loaded, paused (keys act in order)
            self.controller.step(1)
            self.notify("The model is still loading: this step runs once it has loaded (the engine will start "
                        "paused).")
            return
        if self.state.no_engine:  # "press space to pause first" / "send a prompt first" would not help
            self.notify(self.state.no_engine, severity="warning", markup=False)
            return
        if hints.recording_over(self.state, self.live):  # "send a prompt first" is no way on in a replay
            self.notify("Nothing to step: the recording has no more steps.", severity="warning")
            return
        # A pause asked for and not yet confirmed counts: the engine takes the step after the pause.
        if not will_pause:
            self.notify("n runs one step while the engine is paused: press space to pause first.",
                        severity="warning")
            return
        if self.live and not self.state.active_requests:  # a replay's next step may bring its requests
            self.notify("Nothing to step: send a prompt first (it waits while paused).", severity="warning")
            return
        self.controller.step(1)

    def action_abort(self) -> None:
        req = self.state.requests.get(self.selected) if self.selected else None
        if not self.live:  # the key is hidden in a replay; the palette or a binding that still got here
            self.notify("A replay plays a recording: its requests cannot be aborted.", severity="warning")
        elif req is None and self.state.no_engine:  # nothing was or will be sent (trial 13's kind)
            self.notify(self.state.no_engine, severity="warning", markup=False)
        elif req is None and not self.state.requests:  # the table is empty: "pick one" had nothing to pick (trial 13)
            self.notify("No request to abort: send a prompt first.", severity="warning")
        elif req is None:
            self.notify("No request is selected: pick one in the Dashboard's table.", severity="warning")
        elif not req.live:
            self.notify(f"{req.request_id} is already {req.state}; nothing to abort.", severity="warning", markup=False)
        else:
            self._aborted_here.add(req.request_id)
            self.controller.abort(req.request_id)

    def action_select(self, delta: int) -> None:
        ids = self.state.request_ids()
        if not ids:
            return
        i = ids.index(self.selected) + delta if self.selected in ids else len(ids) - 1
        self.select(ids[max(0, min(len(ids) - 1, i))])

    async def action_quit(self) -> None:
        self.stop_engine()
        self.exit()

    def on_unmount(self) -> None:
        self.stop_engine()

    def stop_engine(self) -> None:
        """Stop the engine thread (within a second) and close trace files.

        When the process ends with the app (``leaving_process``, set by :func:`main`), a step in
        flight is not waited for: the yield gate closes for good and the engine thread stops at its
        next layer boundary (trial 12c: q during a 1,520-token prefill took over 6 s)."""
        if self._stopped:
            return
        self._stopped = True
        local = self.live and getattr(self.controller, "local_engine", True)  # not a replay, nor a server's
        if self.leaving_process and local and hasattr(self.controller, "is_alive"):
            from nanovllm_core import yield_gate

            yield_gate.GATE.close()
            self.controller.shutdown(timeout=0.0)
            deadline = time.monotonic() + 1.0
            while self.controller.is_alive and time.monotonic() < deadline and not yield_gate.GATE.parked():
                pass
        else:
            self.controller.shutdown(timeout=1.0)
        self.close_recorders()

    def close_recorders(self) -> None:
        """Close the trace files (``--trace``, ``--trace-chrome``), keeping for :func:`main` one line
        each about a recording that ends early (a step still running: its events after this are
        dropped, see ``tracing._Recording``) or could not be written (``recording_failed``).

        The engine thread may still be inside a step here (``stop_engine`` does not wait for it),
        so the recorders must take its late events quietly, as ``nanovllm_core.tracing``'s do."""
        for recorder in self.recorders:
            try:
                recorder.close()
            except OSError as e:
                self.recording_failed = True
                self.exit_lines.append(f"the trace {getattr(recorder, 'path', '')} could not be written: {e}")
                continue
            ended = getattr(recorder, "ended_early", lambda: None)()
            if ended:
                self.exit_lines.append(ended)

    # ------------------------------------------------------------------ prompts

    def _submit(self, prompt: str, settings: PromptSettings) -> str | None:
        if not self.live:  # the prompt bar is disabled in a replay; nothing reaches the (recorded) state
            self.notify(REPLAY_REFUSAL, severity="warning", markup=False)
            return None
        try:
            params = dataclasses.replace(self.sampling, max_tokens=settings.max_tokens,
                                         temperature=settings.temperature)
        except ValueError as e:
            self.notify(f"Bad sampling settings: {e}", severity="error", markup=False)
            return None
        rid = self.submit_request(prompt, params, settings.priority, chat=bool(settings.chat))
        self._unconfirmed[rid] = prompt
        return rid

    def submit_request(self, prompt: str, params: SamplingParams, priority: int = 0, chat: bool = False) -> str:
        """Send a prompt to the engine (``chat``: as a user's message through the model's chat
        template), show it in the table and select it; returns its request id."""
        # fit_context: a max tokens that does not fit after the prompt (as the engine counts it, chat
        # template included) is refused, as `nanovllm` and the server refuse it (issue 29, trial 7)
        rid = self.controller.submit(user_message(prompt) if chat else prompt, params, priority, fit_context=True)
        self.state.submitted(rid, prompt, priority, params.max_tokens, chat=chat)
        if not self.state.ready and self.live:
            self.notify(f"{rid} waits in the queue until the model has loaded.")
        self.select(rid)
        return rid


def main(argv: Sequence[str] | None = None) -> int:
    """The ``nanovllm-tui`` console script. Bad options end with status 2 and one line."""
    from nanovllm_tui.options import build_app

    before = frozenset(threading.enumerate())  # the engine threads that matter at the end are the app's own
    from nanovllm_tui.options import build_parser
    from nanovllm_tui.web import option_dest

    parser = build_parser()  # --web written in full or abbreviated (--we), as argparse takes it
    if any((a := option_dest(arg, parser)) is not None and a.dest == "web"
           for arg in (sys.argv[1:] if argv is None else argv)):
        from nanovllm_tui.web import serve_in_browser

        return serve_in_browser(argv)
    app = build_app(argv)
    from nanovllm_tui.lifetime import end_on_early_signals

    end_on_early_signals()  # a signal before the app's loop is up still ends the process
    app.leaving_process = True
    app.run()
    status = app.return_code or (1 if app.recording_failed else 0)
    for line in app.exit_lines:  # the terminal is the user's again: what the recordings lack, once each
        print(f"nanovllm-tui: {line}", file=sys.stderr, flush=True)
    from nanovllm_tui.lifetime import leave_when_engines_stop

    leave_when_engines_stop(status, ignore=before)  # an engine thread still in a step: no teardown under it
    return status


if __name__ == "__main__":
    sys.exit(main())

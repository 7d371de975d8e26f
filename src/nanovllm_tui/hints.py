"""Hints that name a key, true of the state they are shown in.

A tab's empty state tells the person how the next step will come. Which key does that depends
on the state: ``n`` runs one step only while the engine (or a replay's playback) is paused;
while it runs the step comes on its own; a replay takes no prompts; a replay at its end has no
step to come. Trial 14a: the X-Ray said "press n again while paused" while the engine ran, and
a replay's tabs said "send a prompt". Every tab, toast and panel takes its clause from here.

``live``: False in a replay (``NanoVLLMApp.live``); a live engine may be local or a server's
(``--connect``): both take prompts, pause, and run one step on ``n`` while paused.
"""

from __future__ import annotations

from nanovllm_tui.state import EngineState


def steps_on_n(state: EngineState) -> bool:
    """True when ``n`` runs a step now: the engine (or a replay's playback) is paused, or a pause
    it asked for is not confirmed yet (the step waits for it); False while it runs or resumes."""
    return state.pending == "pausing" or (state.paused and state.pending is None)


def recording_over(state: EngineState, live: bool) -> bool:
    """A replay that has played its last step (the app marks it so, ``EngineState.recording_ended``): no
    step will come. Not "no live request": a recording that starts mid-run (an app attached to a
    server, whose first step is the server's newest before the attach) has no request known before
    its first step, and ``n`` said "the recording has no more steps" before any had played (trial 20d)."""
    return not live and state.unfinished is not None


def next_step(state: EngineState, live: bool) -> str:
    """How steps come now, as a clause: "press n to run a step" (paused), "steps come on their own
    while the engine runs", "send a prompt first" (live, nothing to run), or why none comes (a replay
    at its end, a model still loading)."""
    if recording_over(state, live):
        return "the recording has no more steps"
    if live and not state.ready:
        return "steps begin once the model has loaded" + (" (then n runs one)" if steps_on_n(state) else "")
    if live and not state.active_requests:
        return "send a prompt first" + (" (it waits while paused: then n runs one step)" if steps_on_n(state) else "")
    if steps_on_n(state):
        return f"press n to {'run' if live else 'play'} a step"
    return "steps come on their own while the engine runs" if live else "the replay plays its steps on its own"

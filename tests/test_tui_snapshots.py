"""Snapshots of every tab in a fixed state: the recorded trace replayed to a chosen step.

The SVGs live in the top-level ``snapshots/`` folder (``snapshots/test_tui_snapshots/``). After a deliberate change to the look
of the app, review the new pictures and store them with:

    pytest tests/test_tui_snapshots.py --snapshot-update

A failing run writes ``snapshot_report.html`` showing the old and new pictures side by side.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytest_textual_snapshot

from tests.tui_helpers import XRAY_TRACE, replay_app, wait_until

SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"
SIZE = (120, 40)


class SnapshotsFolderSVG(pytest_textual_snapshot.SVGImageExtension):
    """pytest-textual-snapshot's SVG files, kept in ``snapshots/<test module>/`` instead of beside the tests."""

    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(SNAPSHOTS / Path(test_location.filepath).stem)


@pytest.fixture
def _svg_in_snapshots_folder(monkeypatch):
    monkeypatch.setattr(pytest_textual_snapshot, "SVGImageExtension", SnapshotsFolderSVG)


@pytest.fixture
def snap_compare(_svg_in_snapshots_folder, snap_compare):
    """The plugin's ``snap_compare``, created after the extension above is in place."""
    return snap_compare


def after_steps(steps: int, *keys: str):
    """Replay ``steps`` recorded steps (paused), then press ``keys``; Esc first, so no text cursor blinks."""

    async def run_before(pilot) -> None:
        app = pilot.app
        app.controller.step(steps)
        await wait_until(pilot, lambda: app.state.kv is not None and app.state.kv.step == steps - 1,
                         timeout=20, what=f"step {steps - 1}")
        await pilot.press("escape", *keys)
        await pilot.pause(0.2)

    return run_before


def test_dashboard_during_mixed_prefill_and_decode(snap_compare, tmp_path):
    assert snap_compare(replay_app(tmp_path), terminal_size=SIZE, run_before=after_steps(3))


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (120, 40), (200, 60)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_xray_of_a_batched_prefill_with_every_key_in_its_heatmap(snap_compare, tmp_path, size):
    # tests/data/xray_trace.jsonl.gz: a 43-token prompt prefilled beside a 5-token one (a batch of 48)
    assert snap_compare(replay_app(tmp_path, trace=XRAY_TRACE), terminal_size=size, run_before=after_steps(1, "2"))


def test_narrator_commentary(snap_compare, tmp_path):
    assert snap_compare(replay_app(tmp_path), terminal_size=SIZE, run_before=after_steps(3, "3"))


def test_tutorial_chapter_with_an_answered_quiz(snap_compare, tmp_path):
    assert snap_compare(replay_app(tmp_path), terminal_size=SIZE, run_before=after_steps(1, "4", "b"))


def test_block_map_with_shared_prefix_blocks(snap_compare, tmp_path):
    # request 1 selected: its first two blocks are the ones it shares with request 0
    assert snap_compare(replay_app(tmp_path), terminal_size=SIZE, run_before=after_steps(4, "5", "left_square_bracket"))


def test_dashboard_on_a_60x20_terminal(snap_compare, tmp_path):
    assert snap_compare(replay_app(tmp_path), terminal_size=(60, 20), run_before=after_steps(4))


# The three views that change most with the terminal's size, at the other sizes people use
# (60x20 is the smallest the app supports; 120x40 is above).
OTHER_SIZES = [pytest.param((60, 20), id="60x20"), pytest.param((80, 24), id="80x24"),
               pytest.param((200, 60), id="200x60")]


@pytest.mark.parametrize("size", [s for s in OTHER_SIZES if s.id != "60x20"])  # 60x20: above, after step 3
def test_dashboard_at(snap_compare, tmp_path, size):
    assert snap_compare(replay_app(tmp_path), terminal_size=size, run_before=after_steps(3))


@pytest.mark.parametrize("size", OTHER_SIZES)
def test_xray_at(snap_compare, tmp_path, size):
    assert snap_compare(replay_app(tmp_path), terminal_size=size, run_before=after_steps(1, "2"))


@pytest.mark.parametrize("size", OTHER_SIZES)
def test_narrator_at(snap_compare, tmp_path, size):
    assert snap_compare(replay_app(tmp_path), terminal_size=size, run_before=after_steps(3, "3"))

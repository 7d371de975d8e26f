"""Layering: the engine never imports the UI (import-linter contract in pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contract_holds():
    exe = shutil.which("lint-imports")
    cmd = [exe] if exe else [sys.executable, "-m", "importlinter.cli"]
    proc = subprocess.run(cmd + ["--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 kept, 0 broken" in proc.stdout


def test_contract_would_catch_a_ui_import(tmp_path):
    """The check can fail: a copy of the engine that imports textual breaks the contract."""
    pkg = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "nanovllm_core", pkg / "nanovllm_core")
    shutil.copytree(ROOT / "src" / "nanovllm_tui", pkg / "nanovllm_tui")
    (pkg / "nanovllm_core" / "leak.py").write_text("import textual\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    exe = shutil.which("lint-imports")
    cmd = [exe] if exe else [sys.executable, "-m", "importlinter.cli"]
    env = {**os.environ, "PYTHONPATH": str(pkg)}
    proc = subprocess.run(cmd + ["--config", str(tmp_path / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "broken" in proc.stdout, proc.stdout + proc.stderr

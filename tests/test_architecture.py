"""Layering, kept by import-linter (contracts in pyproject.toml) and by grimp's import graph.

- the engine never imports the UI (a ``forbidden`` contract);
- ``nanovllm_core`` is built in one-way floors (a ``layers`` contract, ground floor last):
  a module imports only from floors below its own, lazy (function-level) and
  ``TYPE_CHECKING`` imports included;
- every module of ``nanovllm_core`` stands on a floor, and its import graph has no circle.

Each check is shown to fail on a planted violation, so a green run means something.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def lint_imports(config: Path, cwd: Path, src: Path = SRC) -> subprocess.CompletedProcess:
    """Run import-linter on ``config`` with ``src`` first on the import path (not the installed copy)."""
    exe = shutil.which("lint-imports")
    cmd = [exe] if exe else [sys.executable, "-m", "importlinter.cli"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd + [str(config), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def layers_contract() -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "layers"]
    return contract


def floors() -> list[list[str]]:
    """The layers contract's floors, top first, as full module names."""
    return [[f"nanovllm_core.{m.strip()}" for m in layer.replace(":", "|").split("|")]
            for layer in layers_contract()["layers"]]


def core_graph() -> grimp.ImportGraph:
    sys.path.insert(0, str(SRC))  # the working tree's package, not the editable install's
    try:
        return grimp.build_graph("nanovllm_core", cache_dir=None)
    finally:
        sys.path.remove(str(SRC))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``edges`` (module -> modules it imports) as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_import_linter_contracts_hold():
    proc = lint_imports(ROOT / "pyproject.toml", ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout


def planted_copy(tmp_path: Path, module: str, code: str) -> Path:
    """A copy of both packages and pyproject.toml under ``tmp_path`` with ``code`` appended to ``module``."""
    pkg = tmp_path / "src"
    shutil.copytree(SRC / "nanovllm_core", pkg / "nanovllm_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SRC / "nanovllm_tui", pkg / "nanovllm_tui", ignore=shutil.ignore_patterns("__pycache__"))
    target = pkg / Path(*module.split(".")).with_suffix(".py")
    target.write_text(target.read_text() + code)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return pkg


def test_contract_would_catch_a_ui_import(tmp_path):
    """The check can fail: a copy of the engine that imports textual breaks the forbidden contract."""
    pkg = planted_copy(tmp_path, "nanovllm_core.events", "\nimport textual  # planted\n")
    proc = lint_imports(tmp_path / "pyproject.toml", tmp_path, src=pkg)
    assert proc.returncode != 0 and "The engine never imports the UI layer BROKEN" in proc.stdout, proc.stdout


@pytest.mark.parametrize("module, code", [
    # The engine building the X-Ray itself, inside a function (how the old circle hid).
    ("nanovllm_core.engine.scheduler",
     "\n\ndef _planted():\n    from nanovllm_core.educational.xray import XRayCapture\n\n    return XRayCapture\n"),
    # A value type reaching up for the model, named for type checkers only.
    ("nanovllm_core.config",
     "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from nanovllm_core.model.llama import LlamaForCausalLM\n"),
], ids=["lazy-engine-to-educational", "type-checking-config-to-model"])
def test_layers_contract_catches_a_planted_upward_import(tmp_path, module, code):
    """The check can fail: one upward import, lazy or for type checkers only, breaks the layers contract."""
    pkg = planted_copy(tmp_path, module, code)
    proc = lint_imports(tmp_path / "pyproject.toml", tmp_path, src=pkg)
    assert proc.returncode != 0, proc.stdout
    assert "nanovllm_core is built in one-way floors BROKEN" in proc.stdout, proc.stdout
    assert "The engine never imports the UI layer KEPT" in proc.stdout, proc.stdout
    assert module in proc.stdout, proc.stdout  # the report names the importer


def unplaced(modules: set[str], placed: list[str]) -> list[str]:
    """The modules no floor covers (a floor covers a module and its descendants); the
    packages whose modules stand on different floors (``engine``) are only containers."""
    containers = {m.rsplit(".", 1)[0] for m in placed if m.count(".") > 1} | {"nanovllm_core"}
    return sorted(m for m in modules if m.startswith("nanovllm_core") and m not in containers
                  and not any(m == p or m.startswith(p + ".") for p in placed))


def test_every_core_module_stands_on_a_floor():
    """A new module must be placed in the layers contract, or the contract would not see it."""
    missing = unplaced(set(core_graph().modules), [m for floor in floors() for m in floor])
    assert missing == [], f"put these on a floor of the layers contract in pyproject.toml: {missing}"


def test_a_module_on_no_floor_is_found():
    placed = [m for floor in floors() for m in floor]
    assert unplaced({"nanovllm_core.engine.new_part", "nanovllm_core.attention.new_kernel"}, placed) == [
        "nanovllm_core.engine.new_part"]


def test_the_core_import_graph_has_no_circle():
    """No module of nanovllm_core reaches itself through imports (lazy ones included)."""
    graph = core_graph()
    edges = {m: {n for n in graph.find_modules_directly_imported_by(m) if n.startswith("nanovllm_core")}
             for m in graph.modules if m.startswith("nanovllm_core")}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_find_cycle_finds_a_planted_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_the_engine_never_imports_educational_not_even_lazily():
    """engine/ reaches the X-Ray only through its observer hook (tests/test_observer_hook.py)."""
    graph = core_graph()
    for m in (m for m in graph.modules if m.startswith("nanovllm_core.engine")):
        assert not any(n.startswith("nanovllm_core.educational") for n in graph.find_modules_directly_imported_by(m)), m

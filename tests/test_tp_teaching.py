"""Tensor parallelism as the teaching views show it: shard shapes under the Megatron split, the sizes
that split a model, the X-Ray's and the dashboards' per-rank lines, the narrator's communication
entry, the chapter's derived numbers, and the measured all-reduce latency (a real gloo group)."""

from __future__ import annotations

import io
import time
from dataclasses import replace

import pytest
from rich.console import Console

from nanovllm_core import events as ev
from nanovllm_core.config import ModelConfig
from nanovllm_core.educational import tp_facts
from nanovllm_core.educational.tutorial import chapter, model_facts

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=2048, tie_word_embeddings=True)
INFO = {"model_name": "m", "device": "cpu", "dtype": "float32", "num_layers": 30, "hidden_size": 576,
        "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152,
        "num_parameters": 134_515_008, "kv_bytes_per_token": 46080, "block_size": 16, "num_kv_blocks": 8}
TINY = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 16, "vocab_size": 1000, "dtype": "float32"}


def trace(layer=4, num_batch_tokens=5) -> ev.LayerTrace:
    return ev.LayerTrace(step=2, request_id="0", layer=layer, num_layers=30, tensors=(), ops=(), num_heads=9,
                         num_kv_heads=3, head_dim=64, hidden_size=576, kv_bytes_per_token=46080,
                         num_batch_tokens=num_batch_tokens, num_new_tokens=num_batch_tokens,
                         context_len=num_batch_tokens, part="prefill")


def timed(step=3, tokens=1, n=3, compute=(0.010, 0.011, 0.012), comm=(0.008, 0.007, 0.004), count=61,
          nbytes=140_544, wall=0.020) -> ev.StepTimed:
    return ev.StepTimed(step=step, wall_time_s=wall, num_tokens=tokens, num_prefill_tokens=0, num_decode_tokens=tokens,
                        prefill_tokens_per_s=0.0, decode_tokens_per_s=tokens / wall, kv_bytes_used=0,
                        kv_bytes_total=8 * 16 * 46080, num_running=1, num_waiting=0, num_blocks_used=1,
                        num_blocks_total=8, tp_size=n, tp_compute_s=compute, tp_comm_s=comm, tp_all_reduces=count,
                        tp_all_reduce_bytes=nbytes)


ONE_PROCESS = replace(timed(), tp_size=1, tp_compute_s=(), tp_comm_s=(), tp_all_reduces=0, tp_all_reduce_bytes=0)


# ------------------------------------------------------------------ shard arithmetic


def test_smollm2_splits_over_one_or_three_ranks_and_each_rank_holds_a_third():
    assert tp_facts.valid_sizes(9, 3, 1536) == [1, 3]
    shards = tp_facts.shard_shapes(SMOLLM2, 3)
    assert [s.rank for s in shards] == [0, 1, 2]
    assert [s.q_heads for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2), (2, 3)]  # each query head's KV head on its rank
    for s in shards:
        assert (s.q, s.k, s.v, s.o) == ((576, 192), (576, 64), (576, 64), (192, 576))  # 3 heads x 64; 1 KV head
        assert (s.gate, s.up, s.down) == ((576, 512), (576, 512), (512, 576))  # 1536 / 3
        assert s.embedding == (16384, 576) and s.lm_head == (576, 16384)
    assert [s.vocab_rows for s in shards] == [(0, 16384), (16384, 32768), (32768, 49152)]
    # the shards add up to the whole layer
    assert sum(s.q[1] for s in shards) == 9 * 64 and sum(s.down[0] for s in shards) == 1536


def test_a_tiny_four_query_two_kv_head_model_splits_in_two():
    assert tp_facts.valid_sizes(4, 2, 128) == [1, 2]
    a, b = tp_facts.shard_shapes(TINY, 2)
    assert (a.q, a.k, a.o, a.gate, a.down) == ((64, 32), (64, 16), (32, 64), (64, 64), (64, 64))
    assert a.q_heads == (0, 2) and b.q_heads == (2, 4) and a.kv_heads == (0, 1) and b.kv_heads == (1, 2)
    # the engine needs N to divide the vocabulary too (model.parallel.split_sizes): 500 rows each
    assert (a.vocab_rows, b.vocab_rows) == ((0, 500), (500, 1000)) and b.embedding == (500, 64)


def test_the_model_info_and_the_model_config_give_the_same_shards():
    assert tp_facts.shard_shapes(INFO, 3) == tp_facts.shard_shapes(SMOLLM2, 3)


@pytest.mark.parametrize("n", [2, 4, 9, 0, -3, True, "3", 1.0])
def test_a_size_that_does_not_split_the_heads_is_a_one_line_error_naming_the_sizes_that_do(n):
    with pytest.raises(ValueError) as err:
        tp_facts.shard_shapes(SMOLLM2, n)
    message = str(err.value)
    assert "\n" not in message and message.endswith("use one of 1, 3")
    assert "9 query / 3 KV heads" in message


def test_the_intermediate_size_bounds_the_split_too():
    assert tp_facts.valid_sizes(8, 4, 6) == [1, 2]  # 4 would split the heads but not the 6 features
    assert tp_facts.valid_sizes(8, 4) == [1, 2, 4]


@pytest.mark.parametrize("heads", [(0, 1), (9, 0), (9, 2), (-4, 2)])
def test_heads_that_cannot_form_groups_are_refused(heads):
    with pytest.raises(ValueError, match="query heads a multiple of KV heads"):
        tp_facts.valid_sizes(*heads)


def test_a_missing_size_is_named():
    with pytest.raises(ValueError, match="positive integer intermediate_size, got None"):
        tp_facts.shard_shapes({k: v for k, v in INFO.items() if k != "intermediate_size"}, 3)


def test_a_token_runs_two_all_reduces_a_layer_and_one_for_the_embedding():
    assert tp_facts.allreduces_per_step(30) == 61
    assert tp_facts.allreduce_bytes_per_token(576, 4, 30) == 61 * 576 * 4 == 140_544
    assert tp_facts.allreduce_bytes_per_token(576, 2, 30) == 70_272  # bfloat16 activations
    assert tp_facts.lm_head_gather_bytes(49152, 3, 2) == 2 * 16384 * 4


# ------------------------------------------------------------------ X-Ray


@pytest.mark.parametrize("tokens", [1, 7, 48])
def test_the_xray_shows_each_ranks_shards_and_the_bytes_of_this_steps_all_reduces(tokens):
    lines = tp_facts.xray_lines(trace(num_batch_tokens=tokens), {**INFO, "tensor_parallel_size": 3})
    text = "\n".join(lines)
    assert "layer 4's weights on each rank" in text
    assert "rank 2: q [576, 192] (query heads 6-8), k and v [576, 64] each (KV head 2)" in text
    assert "gate and up [576, 512] each, down [512, 576]" in text
    per = tokens * 576 * 4
    assert f"T = {tokens}: each all-reduce takes {tokens} x 576 x 4 bytes = {per:,} bytes" in text
    assert f"({2 * per:,} for the layer;" in text and f"61 all-reduces, {61 * per:,} bytes per rank" in text


def test_the_xray_adds_nothing_for_one_process_or_a_size_it_cannot_check():
    assert tp_facts.xray_lines(trace(), INFO) == []
    assert tp_facts.xray_lines(trace(), {**INFO, "tensor_parallel_size": 1}) == []
    assert tp_facts.xray_lines(trace(), {"tensor_parallel_size": 3}) == []  # sizes unknown: nothing guessed
    lines = tp_facts.xray_lines(trace(num_batch_tokens=0), {**INFO, "tensor_parallel_size": 3})
    assert lines and not any("each all-reduce takes" in line for line in lines)  # an older trace: no T


def test_the_cli_xray_layer_detail_is_unchanged_at_n_1_and_adds_the_shards_when_split():
    from nanovllm_core.educational.xray_view import render_layer_detail

    def show(info):
        buf = io.StringIO()
        Console(file=buf, width=200, highlight=False).print(render_layer_detail(trace(), info))
        return buf.getvalue()

    assert show(None) == show(INFO) == show({**INFO, "tensor_parallel_size": 1})
    split = show({**INFO, "tensor_parallel_size": 3})
    assert "Tensor parallel over 3 ranks" in split and "rank 0: q [576, 192]" in split


# ------------------------------------------------------------------ dashboard


def test_the_dashboard_lines_split_each_ranks_time_and_say_what_they_include():
    lines = tp_facts.dashboard_lines(timed())
    assert lines[:3] == ["rank 0: compute 10.00 ms · communication 8.00 ms (44%)",
                         "rank 1: compute 11.00 ms · communication 7.00 ms (39%)",
                         "rank 2: compute 12.00 ms · communication 4.00 ms (25%)"]
    assert lines[3] == "step 3: 1 token, wall 20.00 ms; 61 all-reduces a rank, 140,544 bytes from each"
    assert "compute + communication = the rank's forward pass" in lines[4] and "rank 0's whole step" in lines[4]
    assert "all-reduces and its logits gather" in lines[4]


@pytest.mark.parametrize("step", [ONE_PROCESS, timed(tokens=0), replace(timed(), tp_comm_s=()),
                                  replace(timed(), tp_compute_s=(0.01, 0.01)), replace(timed(), tp_comm_s=(-1, 0, 0))],
                         ids=["one-process", "no-tokens", "no-comm-times", "a-rank-missing", "negative"])
def test_nothing_is_shown_or_told_when_the_step_cannot_say_where_its_time_went(step):
    assert tp_facts.dashboard_lines(step) == [] and tp_facts.waited_on_communication(step) is None


def render_cli_dashboard(step: ev.StepTimed) -> str:
    from nanovllm_core.educational.dashboard_view import DashboardView

    buf = io.StringIO()
    view = DashboardView(Console(file=buf, width=120, highlight=False), INFO)
    view(step)
    view.stop()
    return buf.getvalue()


def test_the_cli_dashboard_shows_the_split_only_for_a_split_step():
    split = render_cli_dashboard(timed())
    assert "Where the last step's time went (3 ranks)" in split and "rank 2: compute 12.00 ms" in split
    one = render_cli_dashboard(ONE_PROCESS)
    assert "Where the last step's time went" not in one and "rank 0" not in one


# ------------------------------------------------------------------ narrator


def feed(narrator, step: ev.StepTimed):
    from tests.test_narrator import entry, planned

    plan = planned(step.step, [entry(kind="decode", num=1, start=3, total_len=4)])
    return narrator.feed(plan) + narrator.feed(step)


def test_the_narrator_says_a_step_waited_on_communication_with_the_measured_figures():
    from nanovllm_core.educational.narrator import Narrator

    notes = [n for n in feed(Narrator(INFO), timed()) if n.kind == "communication"]
    (note,) = notes
    assert note.title == "Step 3 waited on communication" and note.step == 3
    assert "rank 0 8.00 ms of its 18.00 ms (44%); rank 1 7.00 ms of its 18.00 ms (39%)" in note.text
    assert "61 all-reduces a rank, 140,544 bytes from each, and the logits gather; 129 µs a collective on average on rank 0" in note.text
    assert "This step of 1 token waited" in note.text


@pytest.mark.parametrize("step", [ONE_PROCESS, timed(comm=(0.001, 0.001, 0.001)), timed(tokens=0),
                                  replace(timed(), tp_compute_s=())],
                         ids=["one-process", "below-threshold", "no-tokens", "fields-missing"])
def test_the_narrator_says_nothing_of_communication_when_it_cannot_be_true(step):
    from nanovllm_core.educational.narrator import Narrator

    assert not [n for n in feed(Narrator(INFO), step) if n.kind == "communication"]


def test_the_threshold_is_the_busiest_ranks_share():
    # rank 2 alone spends a fifth of its time in all-reduces: told, naming that rank's average
    step = timed(compute=(0.02, 0.02, 0.008), comm=(0.001, 0.001, 0.002), count=10)
    text = tp_facts.waited_on_communication(step)
    assert text is not None and "182 µs a collective on average on rank 2" in text
    assert tp_facts.waited_on_communication(step, threshold=0.21) is None


def test_the_tp_fields_round_trip_through_json_and_default_for_older_traces():
    step = timed()
    back = ev.from_json(ev.to_json(step))
    assert back == step and back.tp_comm_s == (0.008, 0.007, 0.004)
    older = ev.to_json(ONE_PROCESS).replace(',"tp_size":1,"tp_forward_s":[],"tp_compute_s":[],"tp_comm_s":[],'
                                            '"tp_all_reduces":0,"tp_all_reduce_bytes":0,"tp_gather_bytes":0', "")
    assert "tp_" not in older and ev.from_json(older) == ONE_PROCESS


# ------------------------------------------------------------------ the chapter


def test_the_chapter_facts_are_derived_from_the_model():
    lines = model_facts(chapter("tensor_parallel"), INFO)
    assert lines[0].startswith("Its 9 query heads share 3 KV heads") and "splits over 1 or 3 ranks; 2 would cut a KV " \
        "head." in lines[0]
    assert "At N = 3 (if it were split) each rank holds 3 query heads and 1 KV head" in lines[1]
    assert "q [576, 192], k and v [576, 64], o [192, 576], gate and up [576, 512], down [512, 576]" in lines[1]
    assert "16,384 of the 49,152 vocabulary rows" in lines[1]
    assert "2 x 30 + 1 = 61 all-reduces of [1, 576] in float32 (2,304 bytes each, 140,544 bytes a token" in lines[-1]
    tiny = model_facts(chapter("tensor_parallel"), TINY)
    assert "splits over 1 or 2 ranks; 3 would cut a KV head." in tiny[0] and "At N = 2" in tiny[1]
    running = model_facts(chapter("tensor_parallel"), {**INFO, "tensor_parallel_size": 3})
    assert "At N = 3 (as this engine runs it)" in running[1]
    assert model_facts(chapter("tensor_parallel"), {"num_kv_heads": 3}) == []  # sizes missing: nothing guessed


def test_the_quiz_answer_follows_from_the_rule_the_chapter_states():
    q = chapter("tensor_parallel").quiz
    assert q.choices[q.answer] == ", ".join(map(str, tp_facts.valid_sizes(12, 4)[:-1])) + " and 4" == "1, 2 and 4"
    text = " ".join(chapter("tensor_parallel").paragraphs)
    assert "N must divide the number of KV heads" in text and "2 x layers + 1 all-reduces" in text
    assert "two all-reduces per layer" in text and "tens to hundreds of microseconds" in text


def test_the_demonstration_words_derive_a_tokens_communication_from_the_measured_latency():
    from nanovllm_core.educational.tp_measure import AllReduceLatency
    from nanovllm_core.educational.tp_facts import communication_words

    m = AllReduceLatency(p50_us=100.0, p99_us=350.0, world_size=3, iters=200, hidden=576, nbytes=2304,
                         backend="gloo", machine="AMD EPYC")
    steps = [replace(ONE_PROCESS, wall_time_s=0.004), replace(ONE_PROCESS, wall_time_s=0.006)]
    text = communication_words(m, 61, steps, "The capital of France is")
    assert "Measured now on AMD EPYC" in text and "took 100 µs at the median and 350 µs at the 99th" in text
    assert "61 x 100 µs = 6.1 ms of communication a token" in text
    # the prompt is named: nothing before the sentence shows one (trial 17b #4: "the same prompt" had no referent)
    assert ("One process decoded the chapter's demo prompt ('The capital of France is') at 5.0 ms a step (mean of 2 "
            "decode steps") in text and "1.2x that" in text and "same prompt" not in text
    assert "One process" not in communication_words(m, 61, [])



def test_the_demonstration_names_the_weight_format_and_a_busy_host():
    """Trial 34e: chapter 13 timed one process over the loaded Q4_1 GGUF while the split ranks ran float32,
    and put the whole gap on the split; on a busy host its one-process step (570 ms) read slower than the
    split steps with no word of the load. The words now name the format and the busy host."""
    from nanovllm_core.educational.tp_facts import communication_words
    from nanovllm_core.educational.tp_measure import AllReduceLatency

    m = AllReduceLatency(p50_us=100.0, p99_us=350.0, world_size=3, iters=200, hidden=576, nbytes=2304,
                         backend="gloo", machine="AMD EPYC")
    steps = [replace(ONE_PROCESS, wall_time_s=0.004)]
    gguf = communication_words(m, 61, steps, "The capital of France is", weights="q4_1+q8_0 gguf")
    assert "That process ran the loaded model's q4_1+q8_0 gguf; a split engine runs float weights" in gguf
    assert "part of a split step's gap to this one is the weight format, not the split" in gguf
    assert "weight format" not in communication_words(m, 61, steps)  # float weights: the same format both ways
    busy = communication_words(m, 61, steps, busy="warning: the host was busy (load average 5.0 on 2 cores at the "
                                                    "end): other work shared the CPU")
    assert busy.endswith(" Warning: the host was busy (load average 5.0 on 2 cores at the end): other work shared "
                         "the CPU.")


# ------------------------------------------------------------------ the measurement (a real gloo group)


def test_the_all_reduce_measurement_is_positive_bounded_and_leaves_no_process_group(monkeypatch):
    """Forked ranks where this process has one thread (about a second), then always fresh interpreters (their
    torch imports: seconds): each path measured once. In the whole suite some earlier test has left a thread
    (tqdm's monitor, an app's workers), so the first call already starts fresh interpreters and is the only one."""
    import torch.distributed as dist

    from nanovllm_core.educational import tp_measure

    forked = tp_measure._can_fork()
    start = time.monotonic()
    m = tp_measure.measure_allreduce(2, hidden=576, iters=30, warmup=5, timeout_s=90)
    took = time.monotonic() - start
    assert 0 < m.p50_us <= m.p99_us < 1e6 and m.world_size == 2 and m.nbytes == 2304 and m.iters == 30
    assert not dist.is_initialized()  # the caller never joined; each rank destroyed its group (checked inside)
    assert took < 90
    if forked:  # the fresh-interpreter path has not run yet: run it too
        monkeypatch.setattr(tp_measure, "_can_fork", lambda: False)
        m = tp_measure.measure_allreduce(2, hidden=8, iters=5, warmup=1, timeout_s=90)
        assert 0 < m.p50_us <= m.p99_us and m.nbytes == 32 and not dist.is_initialized()


def test_ranks_are_forked_only_from_a_process_with_one_thread():
    import threading

    from nanovllm_core.educational.tp_measure import _can_fork

    alone = threading.active_count() == 1
    assert _can_fork() == alone
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert _can_fork() is False  # a fork would copy no other thread, and a lock it held stays held
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize("kwargs", [{"world_size": 1}, {"world_size": 9}, {"iters": 0}, {"hidden": 0},
                                    {"warmup": -1}, {"timeout_s": 0}])
def test_the_measurement_refuses_bad_sizes_in_one_line(kwargs):
    from nanovllm_core.educational.tp_measure import measure_allreduce

    with pytest.raises(ValueError, match="measure_allreduce needs 2 <= world_size <= 8"):
        measure_allreduce(**kwargs)


def test_percentile_takes_the_nearest_rank():
    from nanovllm_core.educational.tp_measure import percentile

    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0 and percentile(values, 0) == 1
    with pytest.raises(ValueError):
        percentile([], 50)


# ------------------------------------------------------------------ the app (a recorded trace, made split)


def split_trace(path, n=3):
    """A recorded trace as a split engine would have sent it: ``tensor_parallel_size`` in the model's facts,
    per-rank times in every ``StepTimed`` (rank r computing 10 + r ms, 6 ms in 61 all-reduces)."""
    from nanovllm_tui.replay import load_trace

    out = []
    for e in load_trace(path):
        if isinstance(e, ev.ModelLoading) and e.ready:
            e = replace(e, model_info=e.model_info + (("tensor_parallel_size", n),))
        elif isinstance(e, ev.StepTimed):
            e = replace(e, tp_size=n, tp_compute_s=tuple(0.010 + r / 1000 for r in range(n)), tp_comm_s=(0.006,) * n,
                        tp_all_reduces=61, tp_all_reduce_bytes=61 * e.num_tokens * 576 * 4)
        out.append(e)
    return out


def split_app(tmp_path, path):
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.replay import ReplayController

    return NanoVLLMApp(ReplayController(split_trace(path), start_paused=True), tutorial_path=tmp_path / "t.json")


async def play(pilot, steps: int, *keys: str) -> None:
    from tests.tui_helpers import wait_until

    app = pilot.app
    app.controller.step(steps)
    await wait_until(pilot, lambda: app.state.kv is not None and app.state.kv.step == steps - 1, timeout=20)
    await pilot.press("escape", *keys)
    await pilot.pause(0.2)


@pytest.mark.anyio
async def test_the_app_dashboard_shows_where_a_split_steps_time_went_and_hides_it_for_one_process(tmp_path):
    from tests.tui_helpers import TRACE, replay_app

    app = split_app(tmp_path, TRACE)
    async with app.run_test(size=(120, 40)) as pilot:
        await play(pilot, 2)
        panel = app.query_one("#dash-tp")
        assert panel.display and panel.border_title == "Where the last step's time went (3 ranks)"
        text = str(panel.render())
        assert "rank 2: compute 12.00 ms · communication 6.00 ms (33%)" in text
        t = app.state.timings[-1]
        assert f"step {t.step}: " in text and f"{61 * t.num_tokens * 576 * 4:,} bytes from each" in text
    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await play(pilot, 2)
        assert not app.query_one("#dash-tp").display  # one process: the dashboard as it was


@pytest.mark.anyio
async def test_the_app_xray_shows_each_ranks_shards_for_the_drawn_layer(tmp_path):
    from tests.tui_helpers import XRAY_TRACE

    app = split_app(tmp_path, XRAY_TRACE)
    async with app.run_test(size=(200, 60)) as pilot:
        await play(pilot, 1, "2", "down", "down")
        await pilot.pause(0.2)
        text = " ".join(str(app.query_one("#gqa").render()).split())
        assert "Tensor parallel over 3 ranks (Megatron split): layer 2's weights on each rank" in text
        assert "rank 1: q [576, 192] (query heads 3-5)" in text
        assert "T = 48: each all-reduce takes 48 x 576 x 4 bytes = 110,592 bytes" in text  # the 43 + 5 token batch


@pytest.mark.anyio
async def test_the_app_tutorial_lists_and_draws_the_tensor_parallel_chapter(tmp_path):
    from tests.tui_helpers import replay_app

    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await play(pilot, 1, "4", "left")  # from chapter 1, ← wraps to the last chapter
        text = " ".join(str(app.query_one("#chapter-text").render()).split())
        assert text.startswith("Chapter 13 of 13: Tensor parallelism: one model over several devices")
        assert "splits over 1 or 3 ranks; 2 would cut a KV head." in text  # the replayed model's facts
        assert "Live demonstration: All-reduces measured here" in text
        assert "13 Tensor parallelism" in str(app.query_one("#chapter-list").render())


@pytest.mark.anyio
async def test_the_app_xray_of_a_split_engine_says_nothing_was_captured_and_shows_the_step_from_its_sizes(tmp_path):
    """What a split engine sends today: no LayerTrace at all. The tab says so in one line and still shows the
    chosen layer's shards, the newest step's all-reduce bytes for its token count and each rank's time."""
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.replay import ReplayController
    from tests.tui_helpers import TRACE

    events = [e for e in split_trace(TRACE) if not isinstance(e, ev.LayerTrace)]
    app = NanoVLLMApp(ReplayController(events, start_paused=True), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(200, 60)) as pilot:
        await play(pilot, 2, "2", "down")
        title = " ".join(str(app.query_one("#xray-title").render()).split())
        text = " ".join(str(app.query_one("#pipeline").render()).split())
        t = app.state.timings[-1]
        assert t.num_tokens > 0 and not app.state.xray
        assert f"layer 1/29 (↑↓) · split over 3 ranks · step {t.step}" in title
        assert " ".join(tp_facts.capture_off_line(3).split()) in title
        assert f"Step {t.step}: {t.num_tokens:,} token" in text
        assert "layer 1's weights on each rank" in text and "rank 2: q [576, 192] (query heads 6-8)" in text
        per = t.num_tokens * 576 * 4
        assert f"T = {t.num_tokens}: each all-reduce takes {t.num_tokens} x 576 x 4 bytes = {per:,} bytes" in text
        assert f"61 all-reduces, {t.tp_all_reduce_bytes:,} bytes per rank" in text  # as StepTimed counted them
        assert "rank 2: compute 12.00 ms · communication 6.00 ms (33%)" in text
        assert "GQA over 3 ranks" in str(app.query_one("#gqa").render())  # what each rank holds of the KV cache


def test_the_split_lines_say_nothing_they_cannot_derive():
    info = {**TINY, "tensor_parallel_size": 2}
    lines = tp_facts.untraced_lines(info, step=4, num_tokens=3, layer=1)
    assert lines[0] == tp_facts.capture_off_line(2) and lines[1] == "Step 4: 3 tokens in the batch (T = 3)."
    assert "rank 1: q [64, 32] (query heads 2-3), k and v [64, 16] each (KV head 1), o [32, 64]" in "\n".join(lines)
    assert lines[-1].endswith(f"5 all-reduces, {5 * 3 * 64 * 4:,} bytes per rank).")
    assert tp_facts.untraced_lines(TINY, 4, 3) == []  # one process: the captured X-Ray as it was
    assert tp_facts.untraced_lines(info, 4, 3, layer=2) == []  # no layer 2 in a 2-layer model
    assert tp_facts.untraced_lines({"tensor_parallel_size": 2, "num_layers": 2}, 4, 3) == []  # sizes unknown
    zero = tp_facts.untraced_lines(info, 4, 0)
    assert zero and not any("each all-reduce takes" in line for line in zero)
    # the CLI's rendering of one such step, with the step's measured per-rank time
    from nanovllm_core.educational.xray_view import render_split_step

    step = timed(step=4, tokens=3, n=2, compute=(0.010, 0.011), comm=(0.002, 0.003), count=5, nbytes=5 * 3 * 64 * 4)
    buf = io.StringIO()
    Console(file=buf, width=300, highlight=False).print(render_split_step(info, step, layer=1))
    text = " ".join(buf.getvalue().split())
    assert text.startswith("X-RAY · step 4 · 3 tokens · split over 2 ranks")
    assert "Measured in this step: rank 0: compute 10.00 ms · communication 2.00 ms (17%)" in text
    assert render_split_step(TINY, step) is None


def test_the_tutorial_tab_does_not_tell_a_split_app_to_start_split():
    """Where the app's own engine is already split, the Tutorial tab names that engine, not the option to add."""
    from nanovllm_core.educational.tp_facts import SPLIT_RUN_ELSEWHERE, split_run_words

    assert split_run_words({}) == SPLIT_RUN_ELSEWHERE
    split = split_run_words({"tensor_parallel_size": 3})
    assert "already split over 3 ranks" in split and "--tensor-parallel-size" not in split


def test_the_communication_note_follows_its_steps_tokens_in_the_last_step_too():
    """Trial 7: the last step printed FINISHED and 'KV cache: empty' and only then its communication note,
    while steps 0-2 had it right after their tokens. Every step: tokens, communication, finish, KV cache."""
    from dataclasses import replace

    from nanovllm_core.educational.narrator import Narrator
    from tests.test_narrator import added, entry, finished, planned, sampled

    n = Narrator(INFO)
    n.feed(added(max_tokens=2))
    kinds_of = []
    for step, last in ((0, False), (1, True)):
        n.feed(planned(step, [entry(kind="prefill" if step == 0 else "decode", num=3 if step == 0 else 1,
                                    start=0 if step == 0 else 3, total_len=3 if step == 0 else 4)]))
        n.feed(sampled(step, n_out=step + 1))
        if last:
            n.feed(finished(n_out=2, step=step))
        done = replace(timed(step=step), num_blocks_used=0 if last else 1)
        kinds_of.append([c.kind for c in n.feed(done)])
    for kinds in kinds_of:
        told = kinds.index("communication")
        assert kinds[told - 1] in ("decode", "prefill"), kinds
        assert all(k in ("finished", "kv_cache") for k in kinds[told + 1:]), kinds
    assert kinds_of[1][-2:] == ["finished", "kv_cache"], kinds_of[1]


def test_the_embedding_entry_does_not_ask_for_xray_where_a_split_engine_is_not_traced():
    """Trial 7's kind: with --xray given at N = 3 the entry said "Real values appear when X-Ray capture is on"."""
    from nanovllm_core.educational.narrator import Narrator
    from tests.test_narrator import added, entry, planned
    from tests.test_narrator import timed as one_step

    for info, says in (({**INFO, "tensor_parallel_size": 3}, "an engine split over ranks is not traced"),
                       (INFO, "only in a step X-Ray traces")):
        n = Narrator(info)
        n.feed(added())
        n.feed(planned(0, [entry()]))
        emb = next(c for c in n.feed(one_step(0)) if c.kind == "embedding")
        assert says in emb.text and "when X-Ray capture is on" not in emb.text


def test_the_tensor_parallel_demo_tells_a_split_app_its_engine_is_the_split_run():
    """Trial 17b #3: at TP 3 the app's intro said the split run "would start three more processes beside this
    app's engine", the one-process app's words, while the result said the app's engine is that split run."""
    from nanovllm_core.educational.tutorial import DEMOS

    demo = DEMOS["tensor_parallel"]
    one, split = demo.app_text(1), demo.app_text(3)
    assert "would start three more processes" in one and "where this app's own engine is one process" in one
    assert "This app's own engine is already the model split over 3 ranks" in split
    assert "three more processes" not in split and "one process)" not in split
    assert "rank 0's shard" in split and "`nanovllm --tutorial --tutorial-chapter 13`" in split
    assert DEMOS["kv_cache"].app_text(3) == DEMOS["kv_cache"].watch  # no split words: the usual ones


def test_the_split_demos_heading_says_its_ranks_load_float_shards_not_the_loaded_model():
    """Trial 34e: the split run was headed "On its own engine over the loaded model" while its ranks ran float32
    shards beside a loaded Q4_1 GGUF (its first token's probability was the float model's, 77.25% not 77.37%)."""
    from nanovllm_core.educational.tutorial_demos import engine_heading

    sizes = {"num_kv_blocks": 64, "block_size": 16, "token_budget": 512, "max_num_seqs": 64,
             "scheduling_policy": "priority", "dtype": "float32"}
    split = engine_heading({**sizes, "tensor_parallel_size": 3, "quantization": None})
    assert split.startswith("On its own engine split over 3 ranks, each loading its shard of the model as float32 "
                            "weights: 64 KV blocks of 16 tokens") and "loaded model" not in split, split
    one = engine_heading({**sizes, "quantization": "gguf", "weight_kinds": "q4_1+q8_0"})
    assert one == ("On its own engine over the loaded model: 64 KV blocks of 16 tokens, budget 512 tokens a step, "
                   "at most 64 running, priority policy.")
    text = " ".join(chapter("tensor_parallel").paragraphs)
    assert "splits float layers only" in text  # the chapter says why a GGUF model's ranks read more bytes

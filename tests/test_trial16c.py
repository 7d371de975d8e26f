"""Trial 16c: what the teaching says under tensor parallelism (KV sizes are totals over the ranks and
say so; what each rank holds of the KV cache; the divisibility rule the engine checks), where a
readmission's prefix hit came from, and a speculative cost figure made of noise."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

from nanovllm_core import events as ev
from nanovllm_core.educational import tp_facts
from nanovllm_core.educational.tutorial import chapter, model_facts
from tests.test_tp_teaching import INFO, ONE_PROCESS, SMOLLM2, feed, render_cli_dashboard, timed

SPLIT = {**INFO, "tensor_parallel_size": 3}


def kv_step(n=3) -> ev.StepTimed:
    """A step that took one 737,280-byte block (SmolLM2 float32: 16 x 46,080) of an 8-block pool."""
    return replace(timed(n=n), kv_bytes_used=16 * 46080, num_blocks_used=1)


# ------------------------------------------------------------------ bug 1: KV sizes say they are totals


def test_the_narrator_labels_every_kv_byte_figure_as_a_total_over_the_ranks():
    from nanovllm_core.educational.narrator import Narrator

    narrator = Narrator(SPLIT)
    model = " ".join(c.text for c in narrator.feed(ev.ModelLoading(stage="ready", done=1, total=1, ready=True,
                                                                    model_info=tuple(SPLIT.items()))))
    assert "Each token kept in the KV cache costs 46,080 bytes across 3 ranks (15,360 bytes on each)" in model
    notes = feed(narrator, kv_step())
    (kv,) = [c for c in notes if c.kind == "kv_cache"]
    assert "across 3 ranks" in kv.title
    assert "These bytes are totals across 3 ranks" in kv.text and "240.0 KiB of the reserved bytes" in kv.text
    one = Narrator(INFO)
    (kv1,) = [c for c in feed(one, replace(kv_step(), tp_size=1, tp_compute_s=(), tp_comm_s=()))
              if c.kind == "kv_cache"]
    assert "ranks" not in kv1.text + kv1.title  # one process: as it was


def test_memory_stats_and_the_cli_dashboard_say_the_kv_sizes_are_totals(capsys):
    from nanovllm_core.cli import print_memory_stats

    stats = {"kv_blocks_total": 4, "block_size": 16, "kv_bytes_per_block": 16 * 46080, "kv_bytes_total": 4 * 16 * 46080,
             "kv_blocks_used": 0, "kv_blocks_cached": 0, "kv_blocks_free": 4, "kv_slots_wasted": 0,
             "prefix_caching": False, "num_preemptions": 0, "steps": 1, "tensor_parallel_size": 3}
    print_memory_stats(stats)
    out = capsys.readouterr().out
    assert ("blocks: 4 x 16 tokens (720.0 KiB a block across 3 ranks (240.0 KiB on each); 2.8 MiB in all across "
            "3 ranks (960.0 KiB on each))") in out
    print_memory_stats({**stats, "tensor_parallel_size": 1})
    assert "blocks: 4 x 16 tokens (720.0 KiB each, 2.8 MiB in all)" in capsys.readouterr().out

    from nanovllm_core.educational.dashboard_view import DashboardView

    buf = io.StringIO()
    view = DashboardView(Console(file=buf, width=160, highlight=False), SPLIT)
    view(kv_step())
    view.stop()
    out = buf.getvalue()
    assert "720.0 KiB of 5.6 MiB (whole blocks) across 3 ranks" in out and "240.0 KiB of 1.9 MiB on each rank" in out
    assert "across" not in render_cli_dashboard(ONE_PROCESS).split("KV reserved")[1].split("\n")[0]


def test_the_tutorial_says_what_a_rank_holds_of_the_kv_cache():
    ch13 = " ".join(model_facts(chapter("tensor_parallel"), SPLIT))
    assert ("Each rank's KV cache keeps only its 1 KV head: 2 (K and V) x 30 layers x 1 x 64 x 4 bytes = 15,360 "
            "bytes a token on each rank, 1/3 of the 46,080 the whole model's cache takes; a block of 16 tokens "
            "holds 245,760 bytes on each rank.") in ch13
    assert "15,360 bytes a token on each rank" in " ".join(model_facts(chapter("tensor_parallel"), INFO))  # if split
    kv = " ".join(model_facts(chapter("kv_cache"), SPLIT))
    assert "= 46,080 bytes per token across 3 ranks (15,360 bytes on each)" in kv
    paged = " ".join(model_facts(chapter("paged_attention"), SPLIT))
    assert "737,280 bytes each across 3 ranks (245,760 bytes on each)" in paged
    assert "ranks" not in " ".join(model_facts(chapter("kv_cache"), INFO) + model_facts(chapter("paged_attention"), INFO))


# ------------------------------------------------------------------ bug 4: the X-Ray's GQA panel when split


def test_the_split_xray_says_what_each_rank_holds_of_the_kv_cache():
    lines = tp_facts.rank_kv_lines(SPLIT)
    assert lines[0].startswith("GQA over 3 ranks: 9 query heads share 3 KV heads")
    assert ("  rank 1: KV head 1, query heads 3-5: 2 (K, V) x 30 layers x 1 x 64 x 4 bytes = 15,360 bytes a token, "
            "245,760 a block of 16") in lines
    assert lines[-1].startswith("Together 46,080 bytes a token across the 3 ranks")
    assert tp_facts.rank_kv_lines(INFO) == [] and tp_facts.rank_kv_lines({**SPLIT, "kv_bytes_per_token": None}) == []

    from nanovllm_core.educational.xray_view import render_split_step

    buf = io.StringIO()
    Console(file=buf, width=400, highlight=False).print(render_split_step(SPLIT, timed()))
    assert "rank 2: KV head 2, query heads 6-8" in buf.getvalue()


@pytest.mark.anyio
async def test_the_app_xray_and_dashboard_of_a_split_engine_show_each_ranks_kv(tmp_path):
    from nanovllm_tui.app import NanoVLLMApp
    from nanovllm_tui.replay import ReplayController
    from tests.test_tp_teaching import play, split_trace
    from tests.tui_helpers import TRACE

    events = [e for e in split_trace(TRACE) if not isinstance(e, ev.LayerTrace)]
    app = NanoVLLMApp(ReplayController(events, start_paused=True), tutorial_path=tmp_path / "t.json")
    async with app.run_test(size=(200, 60)) as pilot:
        await play(pilot, 2)
        bar = " ".join(str(app.query_one("#kv").render()).split())
        assert "over 3 ranks)" in bar and "MiB across 3 ranks (" in bar  # the used bytes and the pool: totals
        await pilot.press("2")
        await pilot.pause(0.3)
        gqa = " ".join(str(app.query_one("#gqa").render()).split())
        assert "GQA over 3 ranks" in gqa and "rank 2: KV head 2, query heads 6-8" in gqa


# ------------------------------------------------------------------ bug 5: the divisibility rule


def test_the_taught_split_rule_is_the_engines_vocabulary_included():
    from nanovllm_core.model import parallel

    text = " ".join(chapter("tensor_parallel").text.split())
    rule = text[text.index("so N must divide"):text.index("vLLM also accepts")]
    for size in parallel.SPLIT_SIZES:
        assert size.split()[0] in rule, size
    assert "the vocabulary" in rule
    # the teaching's sizes are the engine's: a vocabulary of 1001 does not split in 2, whatever the heads
    assert tp_facts.valid_sizes(4, 2, 128, 1001) == [1] == parallel.split_sizes(2, 4, 2, 128, 1001)
    assert tp_facts.valid_sizes(9, 3, 1536, 49152) == parallel.valid_sizes(SMOLLM2, 3) == [1, 3]
    with pytest.raises(ValueError, match="vocabulary of 1001: use one of 1$"):
        tp_facts.check_size(2, tp_facts.dims({**INFO, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
                                              "vocab_size": 1001}))
    odd = {**INFO, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128, "vocab_size": 1001, "head_dim": 16}
    assert "splits over 1 rank; 2 would cut the vocabulary unevenly." in model_facts(chapter("tensor_parallel"), odd)[0]


# ------------------------------------------------------------------ bug 3: where a readmission's hit came from

PROMPT = "The quick brown fox jumps over the lazy dog and then the cat sat on the mat"


def test_a_readmissions_hit_says_whether_its_block_was_held_live_or_cached_free(make_tiny_engine):
    """Two identical 17-token prompts and a higher-priority third in a 5-block pool (the trial's repro):
    request 1 is preempted and readmitted while request 0 still holds the shared block, then again
    after request 0 finished. The engine says which, and so does the narrator."""
    from nanovllm_core.educational.narrator import Narrator
    from nanovllm_core.sampling_params import SamplingParams

    engine = make_tiny_engine(num_kv_blocks=5)
    events: list[ev.Event] = []
    engine.subscribe(events.append)
    narrator = Narrator(engine.model_info())
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    for prompt, priority in ((PROMPT, 0), (PROMPT, 0), ("Python is a", 5)):
        engine.add_request(prompt, params, priority=priority)
    steps = 0
    while engine.has_unfinished_requests() and steps < 200:
        engine.step()
        steps += 1
    told = [c for e in events for c in narrator.feed(e)]
    readmissions = [(e, s) for e in events if isinstance(e, ev.StepPlanned) for s in e.scheduled
                    if s.request_id in e.admitted and s.num_cached_tokens and any(
                        q.seq_id == s.seq_id and q.num_preemptions for q in e.running)]
    assert readmissions, "the repro no longer preempts and readmits with a hit"
    kinds = set()
    for plan, s in readmissions:
        assert s.num_cached_blocks_in_use is not None
        (hit,) = [c for c in told if c.kind == "prefix_cache" and c.step == plan.step and c.request_id == s.request_id]
        if s.num_cached_blocks_in_use:
            kinds.add("live")
            assert "another running request holds for the same tokens" in hit.text
            assert "cached-free" not in hit.text.replace("not a block that had been cached-free", "")
        else:
            kinds.add("cached")
            # whose cached-free block it was: its own from before the preemption, or another request's (trial 17b #2)
            own = s.num_cached_blocks_own
            assert ("its own block from before the preemption, kept cached-free" in hit.text) is bool(own)
            assert ("another request left cached-free with the same tokens" in hit.text) is (own == 0)
    assert kinds == {"live", "cached"}  # the trial's step 15 and step 20
    assert engine.block_manager.num_used_blocks == 0


def test_an_older_trace_without_the_count_claims_nothing_about_where_the_hit_was():
    from tests.test_narrator import entry, planned, queued
    from nanovllm_core.educational.narrator import Narrator

    def told(in_use):
        back = replace(entry("1", num=3, start=32, prompt_len=17, total_len=35, cached=32),
                       num_cached_blocks_in_use=in_use)
        n = Narrator({"block_size": 16})
        out = n.feed(planned(9, [back], running=(queued("1", num_tokens=35, preemptions=1),), admitted=("1",)))
        return next(c.text for c in out if c.kind == "prefix_cache")

    assert "cached-free" not in told(None) and "running request" not in told(None)
    assert "2 blocks that running requests hold" in told(2) and "not blocks that had been cached-free" in told(2)
    mixed = told(1)
    assert "the block that another running request holds" in mixed and "and a block that kept its contents" in mixed
    assert "blocks that kept their contents while they were cached-free" in told(0)



def test_a_readmitted_samples_hit_held_by_a_sequence_is_not_called_another_request():
    """Trial 34e: with n = 3 a readmitted sample's hit block, held by a sibling sample, was "the block that another
    running request holds"; the engine's count does not say whose it is, so for n > 1 the words allow both."""
    import dataclasses

    from tests.test_narrator import added, entry, planned, queued
    from nanovllm_core.educational.narrator import Narrator

    back = replace(entry("1", num=3, start=32, prompt_len=17, total_len=35, cached=32), num_cached_blocks_in_use=1)
    n = Narrator({"block_size": 16})
    n.feed(dataclasses.replace(added("1"), n=3))
    out = n.feed(planned(9, [back], running=(queued("1", num_tokens=35, preemptions=1),), admitted=("1",)))
    text = next(c.text for c in out if c.kind == "prefix_cache")
    assert "another running request" not in text
    assert "the block that another running sequence (another sample of this request, or another request) holds" in text


# ------------------------------------------------------------------ bug 2: the app's chapter 13 promise


@pytest.mark.anyio
async def test_the_app_chapter_13_promises_only_what_it_measures(tiny_model, tmp_path, monkeypatch):
    """The tab measures the all-reduces only: it must not promise a one-process decode step, nor a small
    engine of its own split over 3 ranks, and it says where the comparison is."""
    from nanovllm_core.educational import tp_measure
    from nanovllm_core.educational.tutorial import CHAPTERS, DEMOS, demo_heading
    from nanovllm_tui.views.tutorial import TutorialView
    from tests.test_tui_demos import app_at_chapter, shown
    from tests.tui_helpers import wait_until

    def fake(world_size, hidden, iters, warmup):
        return tp_measure.AllReduceLatency(p50_us=250.0, p99_us=900.0, world_size=world_size, iters=iters,
                                           hidden=hidden, nbytes=hidden * 4, backend="gloo", machine="a test CPU")

    monkeypatch.setattr(tp_measure, "measure_allreduce", fake)
    assert "one-process decode step" in DEMOS["tensor_parallel"].watch  # the CLI does time one
    assert "split over 3 ranks" in demo_heading(CHAPTERS[12])
    app = app_at_chapter(tiny_model, tmp_path, 13)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.state.ready, what="the ready event")
        await pilot.press("escape", "4")
        tutorial = app.query_one(TutorialView)
        await pilot.pause(0.2)
        before = " ".join(str(app.query_one("#chapter-text").render()).split())
        # it times a one-process decode step over the loaded model (trial 16a #3), not the split run
        assert "beside a one-process decode step timed now over the loaded model" in before
        assert "small engine of its own" not in before and "Press r to measure it." in before
        assert "The model split over 3 ranks is not run here" in before
        await pilot.press("r")
        await wait_until(pilot, lambda: not tutorial.measuring and tutorial.measured is not None, what="the measurement")
        await pilot.pause(0.1)
        text = " ".join(shown(tutorial).split())
        assert "One process decoded the chapter's demo prompt ('The capital of France is') at" in text
        assert "No one-process decode step" not in text


def test_the_app_says_why_it_timed_no_one_process_step_where_it_cannot():
    # attached to a server there is no model here; a split engine's model here is rank 0's shard
    attached, split, early = (tp_facts.app_no_baseline(*a) for a in ((False, 1), (True, 3), (True, 1)))
    assert "watches a server and runs no model of its own" in attached and "tutorial-chapter 13" in attached
    assert "split over 3 ranks" in split and "rank 0's shard" in split and "tutorial-chapter 13" in split
    assert "not loaded yet; press r again" in early


# ------------------------------------------------------------------ observation: v < 1 is noise


def test_a_verification_measured_cheaper_than_a_decode_step_is_told_as_noise_not_as_a_speed_up():
    from nanovllm_core.educational import speculative_costs as sc

    # the trial's figures: 201.1 ms a decode step, 156.5 ms a verification of 2.5 drafts, alpha 0.80
    m = sc.Measured(decode_s=0.2011, verify_s=0.1565, draft_s=0.0002, gamma=4, mean_drafts=2.5, alpha=0.8,
                    tokens_per_verify=3.0, plain_s_per_token=0.21, spec_s_per_token=0.087)
    assert m.v < 1
    words = " ".join(sc.cost_words(m, load=" (load average 9.0 on 2 cores)").split())
    noisy = sc.speedup(m.alpha, m.gamma, m.c, m.v)
    assert f"{noisy:.2f}x" not in words and "over (gamma c + v)" not in words
    assert f"the measured v = {m.v:.2f} is below 1" in words and "noise between two medians" in words
    assert "(the host was busy (load average 9.0 on 2 cores))" in words
    assert f"{sc.speedup(m.alpha, m.gamma, m.c):.2f}x if verification cost one decode step" in words
    quiet = " ".join(sc.cost_words(m, load="").split())
    assert "other work on the machine, or the cache warming up" in quiet
    fine = replace(m, verify_s=0.30)  # v = 1.49: the formula's figure, as before
    assert f"over (gamma c + v): {sc.speedup(fine.alpha, fine.gamma, fine.c, fine.v):.2f}x" in sc.cost_words(fine, load="")


# ------------------------------------------------------------------ the weights a split step reads


def test_a_split_decode_step_says_the_weights_it_counts_are_rank_0s_shard():
    # fix 18c, noticed: under tensor parallelism linear_weight_bytes is rank 0's shard, yet the decode
    # chapter called it "this model's weights" and the narrator measured one rank's reading rate
    # against the whole machine's bandwidth while the other ranks read theirs from the same memory.
    from nanovllm_core.educational.narrator import Narrator

    weights = {"linear_weight_bytes": 60_000_000, "linear_weights": 45_000_000, "memory_bandwidth": 20e9,
               "peak_flops": 1e11, "machine": "a CPU (2 threads)"}
    split = " ".join(model_facts(chapter("decode"), {**SPLIT, **weights}))
    assert "rank 0 of its 3 ranks reads its shard's 57.2 MiB" in split and "this model reads its" not in split
    assert "reading the weights (rank 0's shard; the 3 ranks read theirs at once" in split
    one = " ".join(model_facts(chapter("decode"), {**INFO, **weights}))
    assert "this model reads its 57.2 MiB" in one and "rank" not in one
    told = Narrator({**SPLIT, **weights})._bandwidth_share(replace(timed(n=3, tokens=1), tp_size=3))
    assert "No weight-reading rate is told" in told and "rank 0's is 57.2 MiB" in told and "GB/s" not in told
    alone = Narrator({**INFO, **weights})._bandwidth_share(ONE_PROCESS)
    assert "Alone in its step, it read the 57.2 MiB" in alone

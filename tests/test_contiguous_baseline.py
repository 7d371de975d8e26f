"""The contiguous baseline (``paged=False``, ``--no-paged-attention``) is what the docs call it
(trial 20c bug 1): each request's whole max length is reserved when it is admitted, the KV
numbers count the unused part of that reservation as waste, the attention kernel named is the
one that runs, and nothing is looked up in (or counted for) a prefix cache that is off."""

from __future__ import annotations

from nanovllm_core import SamplingParams

PROMPT = "Once upon a time, in a land far far away, there lived a dragon who loved"


def _ids(engine, text):
    return engine.tokenizer.encode(text)


def test_reserves_prompt_plus_max_tokens_at_admission(make_tiny_engine):
    eng = make_tiny_engine(paged=False, block_size=16)
    n = len(_ids(eng, PROMPT))
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    want_blocks = -(-(n + 30) // 16)
    seen = []
    for _ in range(3):
        eng.step()
        s = eng.stats()
        seen.append((s["kv_blocks_used"], s["kv_slots_wasted"]))
    stored = [n, n + 1, n + 2]  # slots with K/V after the prefill step and two decodes (the newest token has none yet)
    assert [u for u, _ in seen] == [want_blocks] * 3
    assert [w for _, w in seen] == [want_blocks * 16 - t for t in stored]
    # The runner's contiguous region is exactly what the pool's accounting holds.
    (cache,) = eng.runner.contiguous.values()
    assert cache.max_len == want_blocks * 16
    while eng.scheduler.has_unfinished():
        eng.step()
    assert eng.stats()["kv_blocks_used"] == 0 and not eng.runner.contiguous


def test_reservation_capped_at_max_model_len(make_tiny_engine):
    eng = make_tiny_engine(paged=False, block_size=16, max_model_len=40)
    n = len(_ids(eng, PROMPT))
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40 - n, ignore_eos=True))
    eng.step()
    assert eng.stats()["kv_blocks_used"] == 3  # 40 tokens -> 3 blocks of 16, not prompt + max_tokens beyond the cap


def test_backend_and_prefix_cache_counters(make_tiny_engine):
    eng = make_tiny_engine(paged=False)
    info = eng.model_info()
    assert info["paged"] is False and info["prefix_caching"] is False
    assert info["attention_backend"] in ("cpu-contiguous", "sdpa", "math")
    assert info["attention_backend"] != "cpu-paged"
    for _ in range(2):
        eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3))
    while eng.scheduler.has_unfinished():
        eng.step()
    s = eng.stats()
    assert s["prefix_cache_queries"] == 0 and s["prefix_cache_hits"] == 0


def test_prefix_caching_off_counts_no_queries_paged(make_tiny_engine):
    """The same kind in the paged engine: --no-prefix-caching looks nothing up, so counts nothing."""
    eng = make_tiny_engine(enable_prefix_caching=False)
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=2))
    while eng.scheduler.has_unfinished():
        eng.step()
    assert eng.stats()["prefix_cache_queries"] == 0


def test_greedy_output_matches_paged(make_tiny_engine):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT, "The capital of France is", "1 2 3 4 5"]
    outs = []
    for paged in (True, False):
        eng = make_tiny_engine(paged=paged)
        ids = [eng.add_request(p, sp) for p in prompts]
        done = {}
        while eng.scheduler.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
        outs.append([done[i] for i in ids])
    assert outs[0] == outs[1]


def test_narrator_and_xray_describe_one_region(make_tiny_engine):
    from nanovllm_core.educational.narrate_view import NarrateView  # noqa: F401 (import check only)
    from nanovllm_core.educational.narrator import Narrator
    from nanovllm_core.educational.xray import backend_of
    from nanovllm_core.educational.xray_costs import BACKEND_NAMES

    eng = make_tiny_engine(paged=False)
    intro = Narrator(eng.model_info()).introduction()[0].text
    assert "contiguous baseline" in intro and "the pool has" not in intro
    desc = BACKEND_NAMES[backend_of(eng)]
    assert "block table" not in desc.replace("no block table", "")


def test_each_reservation_is_a_run_of_adjacent_blocks(make_tiny_engine):
    """Trial 21a bug 1: the baseline took whichever free blocks came first ([6, 7, 2] with 0-2 free) while
    the narrator called the reservation one contiguous region; first fit over adjacent blocks now."""
    eng = make_tiny_engine(paged=False, block_size=4, num_kv_blocks=12)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p in ["The capital of France is", "Python is a", "Tell me about cats"]:
        eng.add_request(p, sp)
    tables = {}
    while eng.scheduler.has_unfinished():
        eng.step()
        for s in eng.scheduler.running:
            tables.setdefault(s.request_id, list(s.block_table))
        eng.block_manager.check_invariants(eng.scheduler.running + eng.scheduler.waiting)
    assert len(tables) == 3
    for t in tables.values():
        assert len(t) > 1 and t == list(range(t[0], t[0] + len(t))), tables
    assert eng.stats()["kv_blocks_used"] == 0


def test_a_fragmented_pool_makes_a_reservation_wait_and_the_narrator_says_why():
    """Enough blocks free in all but no run long enough: the baseline's external fragmentation."""
    from nanovllm_core.engine.block_manager import BlockManager
    from nanovllm_core.engine.scheduler import Scheduler
    from nanovllm_core.engine.sequence import Sequence

    def seq(i, n, max_tokens):
        return Sequence(seq_id=i, request_id=f"r{i}", token_ids=[7] * n, num_prompt_tokens=n,
                        params=SamplingParams(max_tokens=max_tokens))

    bm = BlockManager(6, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=4, token_budget=64, reserve_up_front=True, max_model_len=64)
    a, b, c = seq(0, 4, 4), seq(1, 4, 4), seq(2, 4, 4)  # 2 blocks each: #0-1, #2-3, #4-5
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    assert [x.block_table for x in (a, b, c)] == [[0, 1], [2, 3], [4, 5]]
    for x in (a, c):  # blocks 0-1 and 4-5 free: 4 in all, no run of 3
        s.remove(x)
    big = seq(3, 8, 4)  # 12 tokens: 3 adjacent blocks
    s.add(big)
    plan = s.schedule()
    assert plan.wait_reason == "kv_run" and plan.wait_blocks == (4, 3, 2) and not big.block_table
    bm.check_invariants([b])
    s.remove(b)
    plan = s.schedule()
    assert big.block_table == [0, 1, 2] and plan.wait_reason == ""
    bm.check_invariants([big])



# Trial 22b bug 3: the baseline ignored a given --max-num-seqs / --max-prefill-tokens in silence.

def test_config_refuses_settings_the_baseline_would_ignore():
    import pytest

    from nanovllm_core.config import EngineConfig

    with pytest.raises(ValueError, match=r"^max_num_seqs=4 has no effect with paged=False, which runs one request "
                                         r"at a time; leave it out$"):
        EngineConfig(paged=False, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=4 has no effect with paged=False"):
        EngineConfig(paged=False, max_num_batched_tokens=4)
    assert EngineConfig(paged=False).max_num_seqs == 1 and EngineConfig(paged=False, max_num_seqs=1).max_num_seqs == 1
    assert EngineConfig().max_num_seqs == 64 and EngineConfig(max_num_seqs=64).max_num_seqs == 64
    assert EngineConfig(paged=False).token_budget(96) == 96


def test_command_lines_refuse_them_in_one_line(capsys):
    import pytest

    from nanovllm_core import cli
    from nanovllm_core.entrypoints import cli as serve_cli
    from nanovllm_tui.options import parse_args

    cases = [(["--max-num-seqs", "4"], "--max-num-seqs 4 has no effect with --no-paged-attention, which runs one "
                                        "request at a time; leave it out"),
             (["--max-prefill-tokens", "4"], "--max-prefill-tokens 4 has no effect with --no-paged-attention")]
    for main in (lambda a: cli.main(["--prompt", "Hi", *a]), serve_cli.main, parse_args):
        for extra, want in cases:
            with pytest.raises(SystemExit) as e:
                main(["--no-paged-attention", *extra])
            err = capsys.readouterr().err.strip().splitlines()
            assert e.value.code == 2 and want in err[-1], err
    # The defaults are not given values: the baseline runs with them, and the paged engine takes any value.
    assert parse_args(["--no-paged-attention"]).max_num_seqs is None
    assert parse_args(["--max-num-seqs", "4", "--max-prefill-tokens", "8"]).max_num_seqs == 4


def test_n_above_one_is_refused_with_the_modes_rule(make_tiny_engine):
    eng = make_tiny_engine(paged=False)
    field, reason = eng.request_problem(_ids(eng, PROMPT), SamplingParams(n=2, max_tokens=3))
    assert field == "n" and reason == ("n=2: this engine runs one sequence at a time (the contiguous baseline): use "
                                       "n=1 or run without --no-paged-attention (paged=False)"), reason


def test_narrator_tells_each_admission_and_the_modes_rule_and_budget(make_tiny_engine):
    """Trial 22b: the step admitting the second request had no SCHEDULER entry; the waiting reason read
    'max_num_seqs: 1 sequences are already running'; the budget figure did not say it is max_model_len."""
    from nanovllm_core.educational.narrator import Narrator

    eng = make_tiny_engine(paged=False, max_model_len=96)
    narrator = Narrator(eng.model_info())
    entries = []
    eng.subscribe(lambda e: entries.extend(narrator.feed(e)), topk=0, blocks=False)
    for text in (PROMPT, "Hi there"):
        eng.add_request(text, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while eng.scheduler.has_unfinished():
        eng.step()
    sched = [c.text for c in entries if c.kind == "scheduler"]
    assert sum("newly admitted" in t for t in sched) == 2, sched
    assert any("the contiguous baseline runs one request at a time, and one is running" in t for t in sched), sched
    assert not any("1 sequences" in t for t in sched)
    assert all("96-token budget (max_model_len: the contiguous baseline runs a whole prompt in one step)" in t
               for t in sched if "budget" in t), sched


def test_the_apps_xray_counts_the_region_reserved_up_front(make_tiny_engine):
    """Trial 22b: the app's X-Ray said "34 tokens fill 3 blocks of 16 (14 slots unfilled)" in the
    contiguous baseline, where the request held its whole reserved region (6 blocks = 96 slots, 62
    unfilled), as the Block Map and the narrator said. Its figure is now the engine's reservation."""
    from nanovllm_core import SamplingParams
    from nanovllm_core import events as ev
    from nanovllm_core.educational.xray_facts import new_and_context
    from nanovllm_tui.replay import load_trace
    from nanovllm_tui.state import RequestView
    from nanovllm_tui.views.xray import contiguous_reservation, gqa_text
    from tests.tui_helpers import XRAY_TRACE

    engine = make_tiny_engine(num_kv_blocks=64, paged=False)
    engine.add_request(list(range(5, 37)), SamplingParams(max_tokens=50, temperature=0), request_id="r")
    engine.step()
    held = len(engine.requests["r"].seqs[0].block_table)
    info = engine.model_info()
    req = RequestView("r", "x", max_tokens=50, prompt_len=32)
    reserved = contiguous_reservation(info, req)
    assert reserved == 82 and held == -(-reserved // info["block_size"])  # the engine's own reservation

    trace = next(e for e in load_trace(XRAY_TRACE) if isinstance(e, ev.LayerTrace))
    _, ctx = new_and_context(trace)
    text = gqa_text(trace, 0, 16, max(reserved, ctx)).plain
    blocks = -(-max(reserved, ctx) // 16)
    assert (f"in a region reserved up front (the contiguous baseline): {blocks} blocks of 16 = {blocks * 16} slots, "
            f"{blocks * 16 - ctx} slots unfilled") in text, text
    assert contiguous_reservation({**info, "paged": True}, req) is None  # a paged engine: the blocks its context fills


def test_memory_stats_keep_the_peak_waste_of_the_reservations(make_tiny_engine, capsys):
    """Trial 22b: after a contiguous-baseline run --show-memory-stats said "slots allocated but
    unfilled: 0", the only waste figure, true once every request had released its region; the
    run's peak (the reservations' empty slots) now stands beside it, with its step."""
    from nanovllm_core import LLM, SamplingParams
    from nanovllm_core.cli import print_memory_stats

    llm = LLM.from_engine(make_tiny_engine(num_kv_blocks=64, paged=False))
    llm.generate([list(range(5, 37))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    # 32 + 50 = 82 tokens reserve 6 blocks = 96 slots; the prefill's step ends with the prompt's 32
    # tokens in K/V (its first sampled token has none yet): 64 empty, the most of the run, as the
    # narrator and the Block Map count them (trial 23a: 63, one below theirs)
    assert stats["kv_slots_wasted"] == 0 and stats["kv_slots_wasted_peak"] == 96 - 32
    assert stats["kv_slots_wasted_peak_step"] == 0
    print_memory_stats(stats)
    out = capsys.readouterr().out
    assert "  slots allocated but unfilled: 0 now, at most 64 (at the end of step 0)\n" in out

"""The tutorial's content and progress: thirteen chapters, one right answer each, progress kept on disk."""

from __future__ import annotations

import io
import json
import re

import pytest

from nanovllm_core.educational.tutorial import (CHAPTERS, DEMOS, TutorialProgress, chapter, choice_index, grade,
                                                model_facts)

ORDER = ["tokenization", "embedding", "self_attention", "prefill", "kv_cache", "decode", "sampling",
         "paged_attention", "continuous_batching", "prefix_caching", "chunked_prefill", "speculative_decoding",
         "tensor_parallel"]


def test_thirteen_chapters_in_the_order_of_a_request_through_the_engine():
    assert [c.key for c in CHAPTERS] == ORDER
    assert [c.number for c in CHAPTERS] == list(range(1, 14))


@pytest.mark.parametrize("ch", CHAPTERS, ids=lambda c: c.key)
def test_each_chapter_has_text_and_a_quiz_with_one_right_answer_in_range(ch):
    assert len(ch.paragraphs) >= 2 and all(len(p) > 80 for p in ch.paragraphs)
    q = ch.quiz
    assert q.question.endswith("?")
    assert len(q.choices) == 4 and len(set(q.choices)) == 4 and all(c.strip() for c in q.choices)
    assert 0 <= q.answer <= 3
    assert [grade(ch, i) for i in range(4)].count(True) == 1
    assert len(q.explanation) > 40


def test_right_answers_are_spread_over_a_to_d():
    answers = [c.quiz.answer for c in CHAPTERS]
    even = len(answers) // 4
    assert all(even <= answers.count(i) <= even + 1 for i in range(4))  # 13 chapters: 3, 4, 3, 3


@pytest.mark.parametrize("ch", CHAPTERS, ids=lambda c: c.key)
def test_a_demo_names_a_known_demonstration_and_has_a_prompt(ch):
    assert (ch.demo is None) == (ch.demo_prompt is None)
    if ch.demo is not None:
        demo = DEMOS[ch.demo]
        requests = demo.requests(ch.demo_prompt)
        assert requests[0].prompt == ch.demo_prompt
        assert len(requests) == 1 + len(demo.extra_prompts)
        assert all(1 <= r.params.max_tokens <= 8 for r in requests)  # demos run on a CPU


def test_demo_requests_carry_priorities_and_per_prompt_token_limits():
    demo = DEMOS["chunked_prefill"]
    reqs = demo.requests(chapter("chunked_prefill").demo_prompt)
    assert [r.priority for r in reqs] == [0, 10]
    batching = DEMOS["continuous_batching"].requests("x")
    assert [r.params.max_tokens for r in batching] == [2, 6, 4]
    assert DEMOS["chunked_prefill"].engine_settings()["max_num_batched_tokens"] == 32


def test_the_prefix_caching_demo_prompts_share_a_long_opening_and_run_one_after_the_other():
    reqs = DEMOS["prefix_caching"].requests(chapter("prefix_caching").demo_prompt)
    a, b = reqs[0].prompt, reqs[1].prompt
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 100 and DEMOS["prefix_caching"].sequential


@pytest.mark.parametrize("choice,index", [(0, 0), (3, 3), ("A", 0), ("b", 1), (" C ", 2), ("d", 3)])
def test_grade_accepts_an_index_or_a_letter(choice, index):
    assert choice_index(choice) == index
    ch = CHAPTERS[0]
    assert grade(ch, choice) == (index == ch.quiz.answer)


@pytest.mark.parametrize("bad", [4, -1, "E", "", "AB", True, 1.5, None])
def test_grade_rejects_anything_else_with_a_clear_message(bad):
    with pytest.raises(ValueError, match="answer must be 0-3 or A-D"):
        grade(CHAPTERS[0], bad)


def test_chapter_lookup_names_the_keys_when_unknown():
    assert chapter("decode").number == 6
    with pytest.raises(KeyError, match="tokenization"):
        chapter("nope")


def test_score_counts_the_last_answer_of_each_chapter():
    p = TutorialProgress()
    first, second = CHAPTERS[0], CHAPTERS[1]
    wrong = (first.quiz.answer + 1) % 4
    assert p.record(first, wrong) is False
    assert p.score == 0 and p.answered == 1
    assert p.record(first, "ABCD"[first.quiz.answer]) is True
    assert p.record(second, second.quiz.answer) is True
    assert p.score == 2 and p.answered == 2


def test_progress_saves_and_loads(tmp_path):
    path = tmp_path / "sub" / "progress.json"
    p = TutorialProgress(current=5)
    p.record(CHAPTERS[0], CHAPTERS[0].quiz.answer)
    p.record(CHAPTERS[3], (CHAPTERS[3].quiz.answer + 1) % 4)
    p.save(path)
    back = TutorialProgress.load(path)
    assert back == p and back.score == 1 and back.current == 5


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"current": "x", "answers": 3}',
                                     '{"current": 99, "answers": {"tokenization": 7, "nope": 1, "decode": 2}}'])
def test_a_corrupt_progress_file_gives_a_fresh_or_cleaned_progress(tmp_path, content):
    path = tmp_path / "progress.json"
    path.write_text(content)
    p = TutorialProgress.load(path)
    assert p.current == 0
    assert set(p.answers) <= {"decode"} and all(0 <= v <= 3 for v in p.answers.values())


@pytest.mark.parametrize("content,why", [("not json", "is not JSON"), ("[1, 2]", "is a JSON list, not an object")])
def test_a_malformed_progress_file_is_kept_aside_and_said_so(tmp_path, content, why):
    """Trial 10: a corrupt --progress-file was overwritten by the next answer without a word."""
    from rich.console import Console

    from nanovllm_core.educational.tutorial_view import run_tutorial

    path = tmp_path / "progress.json"
    path.write_text(content)
    p = TutorialProgress.load(path)
    assert p.notice.startswith(f"the tutorial progress file {path} {why}") and "kept as" in p.notice
    assert (tmp_path / "progress.json.bad").read_text() == content and not path.exists()
    path.write_text(content)
    console = Console(file=io.StringIO(), width=300)
    run_tutorial(console, io.StringIO("q\n"), progress_path=path, start=0, demo_runner=None)
    assert f"Note: the tutorial progress file {path} {why}" in console.file.getvalue()


def test_a_missing_progress_file_gives_a_fresh_progress(tmp_path):
    assert TutorialProgress.load(tmp_path / "none.json") == TutorialProgress()


def test_the_default_progress_file_lives_in_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    TutorialProgress(current=2).save()
    path = tmp_path / "nanovllm" / "tutorial_progress.json"
    assert json.loads(path.read_text())["current"] == 2
    assert TutorialProgress.load().current == 2


def test_model_facts_compute_from_the_model_info():
    info = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "kv_bytes_per_token": 46080, "dtype": "float32"}
    (line,) = model_facts(chapter("kv_cache"), info)
    assert "46,080 bytes per token" in line and "x 4 bytes" in line
    assert model_facts(chapter("kv_cache"), {}) == []


# ------------------------------------------------------------------ the terminal tutorial (--tutorial)


def script(letters: list[str]) -> str:
    """Piped input: one answer line per chapter, then an empty line for Enter (none after the last)."""
    return "\n\n".join(letters) + "\n"


def run_tutorial_cli(capsys, monkeypatch, tmp_path, stdin: str, *extra: str):
    from nanovllm_core import cli

    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = cli.main(["--tutorial", "--no-demos", "--progress-file", str(tmp_path / "p.json"), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_piped_right_answers_score_thirteen_of_thirteen(capsys, monkeypatch, tmp_path):
    letters = ["ABCD"[c.quiz.answer] for c in CHAPTERS]
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, script([x.lower() for x in letters]))
    assert code == 0
    assert "Final score: 13/13" in out and "Score: 7/7" in out
    assert all(f"Chapter {c.number} of 13: {c.title}" in out for c in CHAPTERS)
    saved = TutorialProgress.load(tmp_path / "p.json")
    assert saved.score == 13 and saved.current == 0  # finished: the next launch starts over


def test_a_wrong_answer_shows_the_right_one_and_the_explanation(capsys, monkeypatch, tmp_path):
    first = CHAPTERS[0]
    wrong = "ABCD"[(first.quiz.answer + 1) % 4]
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, wrong + "\n")
    assert code == 0
    flat = " ".join(out.split())
    assert f"Not quite: you chose {wrong}; the answer is {'ABCD'[first.quiz.answer]})" in flat
    assert " ".join(first.quiz.explanation.split()) in flat
    assert "Score: 0/1" in flat and "Final score: 0/1" in flat


def test_end_of_input_ends_with_the_score_so_far_and_resumes_next_time(capsys, monkeypatch, tmp_path):
    letters = ["ABCD"[c.quiz.answer] for c in CHAPTERS[:3]]
    letters[1] = "ABCD"[(CHAPTERS[1].quiz.answer + 2) % 4]
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, script(letters) + "\n")
    assert code == 0 and "Final score: 2/3" in out and "Chapter 5 of 13" not in out
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, "")
    assert "Resuming at chapter 4" in out and "Chapter 4 of 13" in out and "Final score: 0/0" in out


def test_an_answer_outside_a_to_d_is_asked_again(capsys, monkeypatch, tmp_path):
    right = "ABCD"[CHAPTERS[0].quiz.answer]
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, f"e\n\n42\n{right}\n")
    assert out.count("Please answer with A, B, C or D") == 3
    assert "Final score: 1/1" in out


def test_q_quits_and_keeps_progress(capsys, monkeypatch, tmp_path):
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, "q\n", "--tutorial-chapter", "6")
    assert code == 0 and "Chapter 6 of 13" in out and "Final score: 0/0" in out
    assert TutorialProgress.load(tmp_path / "p.json").current == 5


def test_q_at_press_enter_quits_before_the_next_chapter(capsys, monkeypatch, tmp_path):
    right = "ABCD"[CHAPTERS[0].quiz.answer]
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, f"{right}\nq\n")
    assert code == 0 and "Press Enter to continue (q quits)" in out
    assert "Chapter 2 of 13" not in out and "Final score: 1/1" in out
    assert TutorialProgress.load(tmp_path / "p.json").current == 1  # resumes at chapter 2


def test_an_unwritable_progress_file_is_reported_once_and_the_tutorial_goes_on(capsys, monkeypatch, tmp_path):
    """The default file (no --progress-file: one given is checked before the tutorial starts, and refused)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the default folder <blocker>/nanovllm cannot be made
    monkeypatch.setattr("sys.stdin", io.StringIO(script(["a", "b"])))
    from nanovllm_core import cli

    code = cli.main(["--tutorial", "--no-demos"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("progress cannot be saved") == 1 and "Final score:" in out
    assert "Progress (not saved):" in out and "Saved progress" not in out


# ------------------------------------------------------------------ live demonstrations on the real model


@pytest.fixture(scope="module")
def demos(real_model):
    from nanovllm_core.educational.tutorial_demos import EngineDemos

    return EngineDemos.from_loaded(*real_model)


def demo_output(demos, key: str) -> str:
    from rich.console import Console

    buf = io.StringIO()
    demos(chapter(key), Console(file=buf, width=120, highlight=False))
    return buf.getvalue()


@pytest.mark.real_model
def test_tokenization_demo_prints_the_tokenizers_ids(demos, real_model):
    text = demo_output(demos, "tokenization")
    ids = real_model[1].encode(chapter("tokenization").demo_prompt)
    assert f"Token ids: [{', '.join(map(str, ids))}]" in text
    assert "DECODE" not in text  # only what the demo is about


@pytest.mark.real_model
def test_chunked_prefill_demo_shows_chunks_priority_and_a_preemption(demos):
    text = demo_output(demos, "chunked_prefill")
    # the engine its numbers come from, stated before them (trial 10: the chapter's facts gave the loaded engine's
    # 512-token budget, and "56 came back from the prefix cache" assumed 8-token blocks nobody mentioned)
    flat = " ".join(text.split())
    assert "On its own engine over the loaded model: 12 KV blocks of 8 tokens, budget 32 tokens a step" in flat
    assert flat.index("On its own engine") < flat.index("CHUNKED PREFILL")
    assert re.search(r"CHUNKED PREFILL · step \d+ · Request 0: prefill chunk 0\.\.", text)
    flat = " ".join(text.split())
    assert "PREEMPTION · Step" in text and "preempted request 0 itself (priority 0)" in flat
    # trial 12: not "none was free": request 0's chunk 56..82 needs 4 more blocks while 3 are free
    assert "Request 0 needed 4 more KV blocks for this step and only 3 were free" in flat
    assert "none of them computed before its preemption" in flat  # tokens 56..82 are new, not recomputed
    assert text.index("Request 1 finished") < text.index("Request 0 finished")  # priority 10 first


@pytest.mark.real_model
def test_speculative_demo_shows_drafts_checked_in_one_pass(demos):
    text = " ".join(demo_output(demos, "speculative_decoding").split())
    assert "SPECULATIVE DECODING · " in text and "The ngram proposer drafted" in text
    assert "in one forward pass" in text and "Greedy verification" in text
    assert "accepted" in text and "rejected" in text  # the chapter's prompt shows both outcomes
    # the cost is measured here, and the speed-up formula includes the drafter's cost and the verification's
    assert "SPECULATIVE_COST · What a verification costs here" in text
    assert re.search(r"verifying forward pass costs v = [\d.]+ decode steps and the ngram drafter c = [\d.]+", text)
    assert ("over (gamma c + v)" in text or "is below 1" in text) and "Theorem 3.8" in text  # v < 1: noise (16c)
    assert "costs almost the same as producing one" not in " ".join(chapter("speculative_decoding").paragraphs)


@pytest.mark.real_model
def test_the_kv_cache_demo_shows_the_cache_after_every_step_as_its_watch_line_promises(demos):
    demo = DEMOS["kv_cache"]
    assert "After each step" in demo.watch
    text = demo_output(demos, "kv_cache")
    steps = demo.max_tokens  # one prefill step (the first token), then one decode step per further token
    told = re.findall(r"KV CACHE · step \d+ · KV cache: (.*)", text)
    assert len(told) == steps
    stored = [int(n) for n in re.findall(r"store (\d+) tokens", " ".join(text.split()))]
    prompt_len = len(stored) and stored[0]
    assert stored == list(range(prompt_len, prompt_len + steps - 1))  # one more token's K/V per step
    assert told[-1] == "empty"  # the last step finished the request and freed its blocks


@pytest.mark.real_model
def test_prefill_demo_measures_its_step_against_the_ridge_point(demos):
    text = " ".join(demo_output(demos, "prefill").split())
    assert re.search(r"ROOFLINE · step \d+ · Request 0: prefill of 5 tokens against the roofline", text)
    assert re.search(r"This step's layer: [\d,]+ FLOPs over [\d,]+ bytes = [\d.]+ FLOP/byte: memory-bound", text)
    if "measured while the host was busy" in text:  # a loaded host's roofline: no token count is told (trial 15a)
        assert "compute-bound from about" not in text and "run `python -m nanovllm_core.roofline`" in text, text
    else:
        assert re.search(r"a prefill becomes compute-bound from about [\d,]+ tokens", text), text


def test_the_prefill_chapter_states_the_measured_ridge_point_when_known():
    info = {"token_budget": 512, "peak_flops": 100e9, "memory_bandwidth": 10e9, "machine": "a CPU (2 threads), float32",
            "compute_bound_tokens": 41}
    lines = model_facts(chapter("prefill"), info)
    assert "ridge point 10.0 FLOP/byte; a prefill becomes compute-bound from about 41 tokens." in lines[-1]
    assert len(model_facts(chapter("prefill"), {"token_budget": 512})) == 1
    text = " ".join(chapter("prefill").paragraphs)
    assert "limited by compute, not by memory" not in text and "ridge point" in text


@pytest.mark.real_model
def test_tensor_parallel_demo_measures_the_all_reduce_and_derives_a_tokens_communication(demos):
    from nanovllm_core.educational.tp_facts import split_engine_available

    text = " ".join(demo_output(demos, "tensor_parallel").split())
    assert re.search(r"between 3 processes \(gloo over 127\.0\.0\.1, one thread each\) took [\d,]+ µs at the median", text)
    m = re.search(r"runs 61 of them one after another: 61 x ([\d,]+) µs = ([\d,.]+) ms of communication a token", text)
    assert m, text
    p50, per_token = int(m[1].replace(",", "")), float(m[2].replace(",", ""))
    assert abs(61 * p50 / 1000 - per_token) <= 0.1  # the median is printed rounded to a microsecond
    assert re.search(r"One process decoded the chapter's demo prompt \('The capital of France is'\) at [\d,.]+ ms "
                     r"a step \(mean of 3 decode steps", text)
    if split_engine_available():  # the engine side is merged: the split run's narrator entries follow
        assert "ACT 4 · DECODE" in text and "The split engine" not in text
    else:
        assert "The split engine (tensor_parallel_size) is not available in this build" in text


@pytest.mark.real_model
def test_prefix_caching_demo_reuses_two_full_blocks(demos):
    text = demo_output(demos, "prefix_caching")
    assert re.search(r"PREFIX CACHE · step \d+ · Request 1: prefix cache hit, 32 tokens", text)


@pytest.mark.real_model
def test_the_tutorial_with_demos_answers_and_demonstrates(demos, tmp_path):
    from rich.console import Console

    from nanovllm_core.educational.tutorial_view import run_tutorial

    buf = io.StringIO()
    result = run_tutorial(Console(file=buf, width=100), io.StringIO("b\n"), progress_path=tmp_path / "p.json",
                          start=0, demo_runner=demos, model_info=demos.load())
    text = buf.getvalue()
    assert result.asked == 1 and result.right == 1
    assert "Live demonstration: A prompt as token ids (on its own fixed prompt 'The capital of France is'" in text and "Token ids: [" in text
    assert "On this model: This model's vocabulary has 49,152 entries" in text


# ------------------------------------------------------------------ chapters agree with the engine


def _seq(seq_id: int, tokens: list[int], priority: int = 0):
    from nanovllm_core.engine.sequence import Sequence
    from nanovllm_core.sampling_params import SamplingParams

    return Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams(), priority=priority)


def _cached(bm, seq) -> None:
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_prefix_caching_quiz_and_text_match_the_block_manager():
    from nanovllm_core.engine.block_manager import BlockManager

    bm = BlockManager(num_blocks=16, block_size=16)
    first = _seq(0, list(range(40)) + [900] * 10)
    _cached(bm, first)
    second = _seq(1, list(range(40)) + [901] * 10)  # shares its first 40 tokens
    assert len(bm.find_cached_prefix(second)) * 16 == int(chapter("prefix_caching").quiz.choices[0]) == 32
    # "a hit never includes the block that holds the prompt's last token ... a whole block at a boundary"
    assert "never includes the block that holds the prompt's last token" in " ".join(chapter("prefix_caching").paragraphs)
    same = _seq(2, list(range(32)))
    _cached(bm, _seq(3, list(range(32))))
    assert len(bm.find_cached_prefix(same)) * 16 == 16  # 32 cached tokens, 16 recomputed


def test_paged_attention_quiz_matches_the_block_count():
    from nanovllm_core.engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=8, block_size=16).blocks_needed(35)
    assert chapter("paged_attention").quiz.choices[chapter("paged_attention").quiz.answer] == \
        f"{blocks} blocks, {blocks * 16 - 35} unfilled"


def test_kv_cache_quiz_matches_the_model_configs_formula():
    import torch

    from nanovllm_core.model.llama import ModelConfig

    def config(kv_heads):
        return ModelConfig(vocab_size=10, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=kv_heads, head_dim=64, rms_norm_eps=1e-5,
                           rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)

    q = chapter("kv_cache").quiz  # asks for the cache without grouped-query attention (one KV head per query head)
    assert q.choices[q.answer] == f"{config(9).kv_bytes_per_token(torch.float32):,}"
    assert f"{config(3).kv_bytes_per_token(torch.float32):,}" in q.choices  # the model's own, printed above: wrong


def test_preemption_quiz_matches_the_schedulers_victim():
    from nanovllm_core.engine.block_manager import BlockManager
    from nanovllm_core.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(num_blocks=8, block_size=16), max_num_seqs=4, token_budget=64, policy="priority")
    early_low, urgent, late_low = _seq(0, [1], priority=0), _seq(1, [1], priority=5), _seq(2, [1], priority=0)
    sched.running = [early_low, urgent, late_low]
    assert sched._victim() is late_low  # "the lowest-priority one, and among equals the latest to arrive"
    assert chapter("chunked_prefill").quiz.answer == 3


def test_the_chapters_name_vllms_opposite_priority_and_this_engines_rules():
    text = {c.key: " ".join(c.paragraphs) for c in CHAPTERS}
    assert "a higher priority value is more important; vLLM's convention is the opposite" in text["chunked_prefill"]
    assert "its default policy is fcfs" in text["chunked_prefill"]
    assert "add up to at least p" in text["sampling"] and "under greedy decoding too" in text["sampling"]
    assert "gathers a sequence's blocks" in text["paged_attention"] and "in place" in text["paged_attention"]
    assert "share their prompt's full blocks through the prefix cache" in text["paged_attention"]
    assert "It does not share the reads of the KV cache" in text["decode"]
    assert "runs 1 + k tokens" in text["speculative_decoding"] and "highest-scoring" in text["speculative_decoding"]
    assert "reused, and only the rest is computed: recomputed where it had computed them" in text["chunked_prefill"]
    # trial 29e: the demo below preempts a request in the middle of its prefill, which has no newest token
    assert "one preempted in the middle of its prefill, as in the demo below, never ran the prompt tokens" \
        in text["chunked_prefill"]
    assert all("9 query heads" not in d.watch for d in DEMOS.values())  # read from the model, not hard-coded


def test_model_facts_compare_weights_and_cache_and_name_the_priority_convention():
    info = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "kv_bytes_per_token": 46080, "dtype": "float32",
            "num_parameters": 134_515_008, "scheduling_policy": "priority", "token_budget": 512}
    kv = model_facts(chapter("kv_cache"), info)
    assert "11,676 tokens of cache weigh as much" in kv[1]  # 134,515,008 x 4 bytes / 46,080
    decode, floor = model_facts(chapter("decode"), info)  # no linear_weights: no per-weight arithmetic
    assert "46,080 bytes of keys and values per token of context" in decode
    assert "a floor on a step's time, not its time" in floor
    (prio,) = model_facts(chapter("chunked_prefill"), info)
    assert "vLLM's priority runs lower values first" in prio


def test_the_decode_chapter_counts_the_weight_bytes_each_step_reads_and_what_q8_0_changes():
    info = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "kv_bytes_per_token": 46080, "dtype": "float32",
            "num_parameters": 134_515_008, "linear_weights": 134_000_000, "memory_bandwidth": 10e9}
    reads, why, bound, q8, floor = model_facts(chapter("decode"), {**info, "linear_weight_bytes": 536_000_000})
    assert "reads its 511.2 MiB of float32 weights" in reads  # 536,000,000 / 2**20
    assert "the linear layers of all 30 decoder layers and the LM head" in reads
    assert "2 FLOPs for its 4.000 bytes: 0.5 FLOP per byte read" in why  # 536e6 / 134e6 bytes a weight
    assert "takes 53.6 ms: at batch 1 no more than 19 tokens/s" in bound  # 536 MB at 10 GB/s
    # Q8_0: 34 bytes per 32 weights, 134e6 x 34 / 32 = 142.4e6 bytes = 135.8 MiB, 536e6 / 142.4e6 = 3.76x
    assert "--quantization q8_0 the same 134 M weights would be about 135.8 MiB" in q8
    assert "3.8x fewer bytes per step" in q8 and "2-core AMD EPYC" in q8
    assert "benchmark_quantization" in floor and "not its time" in floor
    reads, _, bound, q8, _ = model_facts(chapter("decode"), {**info, "linear_weight_bytes": 142_375_000,
                                                             "quantization": "q8_0", "weight_kinds": "q8_0"})
    assert f"135.8 MiB of q8_0 block ({34 / 32:.3f} bytes a weight on average, the blocks' scales and mins included)" in reads
    assert "no more than 70 tokens/s" in bound
    assert "in float32 would be 511.2 MiB a step, 3.8x the bytes" in q8


def test_the_decode_chapter_derives_where_batch_one_sits_from_the_ridge_it_shows():
    """Trial 14c: chapter 6 said a decode token is "far below the ridge point" beside figures of 2.8
    FLOP/byte against a ridge of 4.0-4.6, itself the float matmul's while a Q4_1 kernel ran. Now the
    text asserts nothing, and the figures place each format against its own kernel's measured ridge:
    below (under 0.5x), just below / just above (within 2x), above."""
    text = " ".join(" ".join(chapter("decode").paragraphs).split())
    assert "far below" not in text and "its own kernel's measured ridge point" in text
    weights, count = 84_000_000, 134_400_000  # all Q4_1: 0.625 bytes a weight, 2 / 0.625 = 3.2 FLOP/byte
    info = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "kv_bytes_per_token": 46080, "dtype": "float32",
            "num_parameters": 134_515_008, "linear_weights": count, "linear_weight_bytes": weights,
            "quantization": "gguf", "weight_kinds": "q4_1", "memory_bandwidth": 10e9, "peak_flops": 44e9,
            "machine": "a CPU (2 threads), float32, gguf weights"}

    def why(**more) -> str:
        return model_facts(chapter("decode"), {**info, **more})[1]

    cases = [(360e9, "0.09x", "36.0", "below it", "waits on memory"),
             (40e9, "0.80x", "4.0", "just below it (within 2x: near it)", "about as long"),
             (20e9, "1.60x", "2.0", "just above it (within 2x: near it)", "about as long"),
             (5e9, "6.40x", "0.5", "above it", "FLOPs, not the bytes")]
    for peak, ratio, ridge, where, then in cases:
        line = why(block_peaks=(("q4_1", peak),))
        assert f"3.2 FLOP/byte, {ratio} the Q4_1 block kernel's ridge point of {ridge} FLOP/byte" in line, line
        assert f": {where}" in line and then in line, line
        assert "4.4 FLOP/byte" not in line  # the float matmul's ridge (44 / 10) is not this kernel's
    # No block kernel measured (an older engine's facts): not placed against the float peak's ridge.
    line = why()
    assert "not placed against a ridge point: the Q4_1 kernel's peak was not measured" in line
    assert "below" not in line and "waits on memory" not in line
    # Measured while the host was busy: it says so beside the verdict.
    line = why(block_peaks=(("q4_1", 360e9),), machine="a CPU (2 threads), float32, gguf weights; measured while "
               "the host was busy (its threads got 24% of their cores), so likely low")
    assert "(measured while the host was busy, so the peaks are likely low)" in line
    # Float weights: against the float matmul's ridge, the kernel that multiplies them.
    line = why(quantization=None, weight_kinds="float32", linear_weight_bytes=count * 4, machine="a CPU, float32")
    assert "FLOAT32 weights: 2 FLOPs for 4.000 bytes = 0.5 FLOP/byte, 0.11x the float matmul's ridge point of 4.4" in line


def test_the_prefill_chapter_gives_each_kernels_ridge_point():
    """A block mode: the float matmul's ridge for float operations, the block kernel's for its projections,
    and the prefill's crossing judged each against its own."""
    info = {"token_budget": 512, "peak_flops": 100e9, "memory_bandwidth": 10e9, "compute_bound_tokens": 17,
            "machine": "a CPU (2 threads), float32, gguf weights", "block_peaks": (("q4_1", 360e9),)}
    line = model_facts(chapter("prefill"), info)[-1]
    assert "Q4_1 block kernel peak 360.0 GFLOP/s" in line and "the block kernels' own not measured" not in line
    assert "ridge point 10.0 FLOP/byte for float operations, 36.0 for Q4_1 projections" in line
    assert "compute-bound from about 17 tokens, each operation against its kernel's peak." in line


def test_the_decode_chapter_in_a_block_mode_counts_its_blocks_bytes_against_the_ridge():
    """gguf mode: the bytes a token reads are the blocks' (recomputed here from bytes per weight), each
    format's intensity 2 / b against its own block kernel's measured ridge, the float32 equivalent,
    and no q8_0 forecast."""
    weights, count = 94_371_840, 134_217_728  # an average of 0.703125 bytes a weight
    info = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "kv_bytes_per_token": 46080, "dtype": "float32",
            "num_parameters": 134_515_008, "linear_weights": count, "linear_weight_bytes": weights,
            "quantization": "gguf", "weight_kinds": "q4_1+q8_0", "hidden_size": 576, "memory_bandwidth": 8e9,
            "peak_flops": 56e9, "block_peaks": (("q4_1", 288e9), ("q8_0", 240e9)),
            "machine": "a CPU (2 threads), float32, gguf weights"}
    reads, why, bound, wide, floor = model_facts(chapter("decode"), info)
    b = weights / count
    assert f"reads its {weights / 2**20:.1f} MiB of q4_1+q8_0 block ({b:.3f} bytes a weight" in reads
    assert "the embedding lookup reads one row of 576 numbers per token" in reads
    assert f"2 FLOPs for its {b:.3f} bytes on average: {2 / b:.1f} FLOP per byte read" in why
    # Q4_1: 2 / (20 / 32) = 3.2 FLOP/byte against 288 / 8 = 36 FLOP/byte; Q8_0: 2 / (34 / 32) = 1.9 against 30.
    assert ("Q4_1 weights: 2 FLOPs for 0.625 bytes = 3.2 FLOP/byte, 0.09x the Q4_1 block kernel's ridge point of "
            "36.0 FLOP/byte (288.0 GFLOP/s over 8.0 GB/s): below it") in why
    assert "Q8_0 weights: 2 FLOPs for 1.062 bytes = 1.9 FLOP/byte, 0.06x the Q8_0 block kernel's ridge point of 30.0" in why
    assert "the arithmetic waits on memory" in why and "float matmul" not in why  # not the float peak's 7.0
    assert f"takes {weights / 8e9 * 1e3:,.1f} ms: at batch 1 no more than {8e9 / weights:,.0f} tokens/s" in bound
    assert f"in float32 would be {count * 4 / 2**20:.1f} MiB a step, {count * 4 / weights:.1f}x the bytes" in wide
    assert "--quantization q8_0" not in " ".join([reads, why, bound, wide, floor])
    assert "do not shrink with the weights" in floor
    # Above the ridge the sentence turns around rather than claim memory is the bound.
    _, why, *_ = model_facts(chapter("decode"), {**info, "block_peaks": (("q4_1", 4e9), ("q8_0", 4e9))})  # ridge 0.5
    assert "6.40x the Q4_1 block kernel's ridge point of 0.5 FLOP/byte" in why and "FLOPs, not the bytes" in why
    kv = model_facts(chapter("kv_cache"), info)
    assert f"q4_1+q8_0 block linear layers and LM head take {weights / 2**20:.1f} MiB: " \
           f"{weights // 46080:,} tokens of cache" in kv[1]


def test_the_decode_chapter_text_names_the_block_sizes_of_block_quant():
    from nanovllm_core.model.block_quant import FORMATS

    text = " ".join(chapter("decode").paragraphs)
    for name, size in (("Q8_0", 34), ("Q4_0", 18), ("Q4_1", 20)):
        assert FORMATS[name.lower()].block_bytes == size
        assert f"{size} bytes for {name}" in text or f"{size} for 4-bit {name}" in text or f"{size} for {name}" in text
    assert "stay as they were" in text  # bytes alone do not set the speed


def test_continuous_batching_text_matches_a_step_that_preempts_to_admit():
    from nanovllm_core.engine.block_manager import BlockManager
    from nanovllm_core.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(num_blocks=2, block_size=16), max_num_seqs=4, token_budget=64, policy="priority")
    low, urgent, later = _seq(0, [1] * 20, priority=0), _seq(1, [2] * 20, priority=5), _seq(2, [3] * 4, priority=1)
    sched.add(low)
    sched.schedule()
    sched.add(urgent)
    sched.add(later)
    plan = sched.schedule()
    assert plan.preempted == [low] and plan.admitted == [urgent]  # it preempted, admitted the cause, then no one
    text = " ".join(chapter("continuous_batching").paragraphs)
    assert "a step that had to preempt admits nobody" not in text
    assert "the request that caused the preemption may itself be the one admitted" in text


def test_the_gather_fallback_conditions_are_the_kernels_own_lists_and_each_is_a_real_refusal(monkeypatch):
    """Chapter 8 lists when attention gathers from the kernels' lists, and each listed CPU case is refused."""
    import torch

    from nanovllm_core.attention import cpu_paged
    from nanovllm_core.attention.selector import FLASH_ATTN_FALLBACK_CONDITIONS

    text = " ".join(chapter("paged_attention").paragraphs)
    for words in cpu_paged.FALLBACK_CONDITIONS + FLASH_ATTN_FALLBACK_CONDITIONS[1:]:
        assert " ".join(words.split()) in text
    assert "--no-flash-attn" in text and "bfloat16" in text
    cpu = torch.device("cpu")
    assert cpu_paged.unsupported_reason(cpu, torch.bfloat16, "flash")
    assert cpu_paged.unsupported_reason(cpu, torch.float16, "flash")
    assert cpu_paged.unsupported_reason(cpu, torch.float32, "math")
    monkeypatch.setenv(cpu_paged.ENV_SWITCH, "0")
    assert cpu_paged.unsupported_reason(cpu, torch.float32, "flash")
    monkeypatch.setattr(cpu_paged, "_load", lambda: (None, "no compiler"))
    monkeypatch.delenv(cpu_paged.ENV_SWITCH)
    assert cpu_paged.unsupported_reason(cpu, torch.float32, "flash") == "no compiler"


def test_the_kv_chapters_growth_figures_are_derived_from_the_models_shapes():
    """A decode step: one token's fixed work, plus attention per cached key; where the second overtakes the first."""
    h, i, nh, nkv, hd = 576, 1536, 9, 3, 64
    info = {"kv_bytes_per_token": 46080, "num_layers": 30, "num_kv_heads": nkv, "head_dim": hd, "dtype": "float32",
            "hidden_size": h, "intermediate_size": i, "num_heads": nh}
    projections = 2 * h * (nh + 2 * nkv) * hd + 2 * nh * hd * h + 2 * h * 2 * i + 2 * i * h
    small = 2 * 4 * h + 3 * (nh + nkv) * hd + 2 * h + 5 * i  # two RMSNorms, RoPE on Q and K, two residual adds, SwiGLU
    per_key = nh * (2 * hd + 5 + 2 * hd)
    crossover = next(c for c in range(1, 10**6) if c * per_key >= projections + small)
    (line,) = [x for x in model_facts(chapter("kv_cache"), info) if x.startswith("Per layer")]
    assert f"does {projections + small:,} FLOPs for its one token" in line
    assert f"{per_key:,} more for each cached key" in line and f"reaches the rest at {crossover:,} tokens" in line
    text = " ".join(chapter("kv_cache").paragraphs)
    assert "n^3/6 pairs" in text and "grows linearly" in text


def test_no_demonstration_claims_to_show_the_learners_own_prompt():
    """Every demo sends a fixed prompt of its own: no title or 'Watch' line says "your", and the heading
    that announces a demo names the fixed prompt (trial 7: 'Your prompt as token ids' tokenized a canned one)."""
    import re

    from nanovllm_core.educational import tutorial as tut

    for d in tut.DEMOS.values():
        assert not re.search(r"\byour\b", d.title + " " + d.watch, re.I), d.key
    ch1 = next(c for c in tut.CHAPTERS if c.demo == "tokenization")
    heading = tut.demo_heading(ch1)
    assert repr(ch1.demo_prompt) in heading and "not one you typed" in heading


def test_a_demo_on_an_engine_of_its_own_states_that_engines_settings_in_its_heading():
    """Trial 10: chapter 11 said "On this model: ... a budget of 512 tokens per step" and its demo ran with
    32, 8-token blocks and 12 KV blocks without saying so. Every demo that sets its own engine names it."""
    from nanovllm_core.educational import tutorial as tut

    ch = {c.demo: c for c in tut.CHAPTERS if c.demo}
    assert ("on a small engine of its own with a budget of 32 tokens a step, blocks of 8 tokens, 12 KV blocks"
            in tut.demo_heading(ch["chunked_prefill"]))
    assert "at most 2 requests running" in tut.demo_heading(ch["continuous_batching"])
    assert "blocks of 16 tokens" in tut.demo_heading(ch["prefix_caching"])
    assert "ngram drafts, up to 4 drafted tokens a step" in tut.demo_heading(ch["speculative_decoding"])
    for key, c in ch.items():  # every setting a demo sets is named, none is left out
        heading = tut.demo_heading(c)
        assert ("on a small engine of its own" in heading) == bool(tut.DEMOS[key].engine), key
        for _, value in tut.DEMOS[key].engine:
            assert str(value) in heading, (key, value)
    info = {"num_kv_blocks": 12, "block_size": 8, "token_budget": 32, "max_num_seqs": 256,
            "scheduling_policy": "priority"}
    assert tut.engine_settings_text(info, "ngram", 4) == ("12 KV blocks of 8 tokens, budget 32 tokens a step, "
                                                          "at most 256 running, priority policy, ngram drafts of "
                                                          "up to 4 tokens")


def test_chapter_8_bounds_the_empty_slots_as_the_engine_leaves_them_also_while_speculating(make_tiny_engine):
    """Trial 10: chapter 8 said a request wastes at most its last block's unfilled slots, but speculative
    decoding reserves 1 + k slots before each step; with no draft proposed the early block stays."""
    from nanovllm_core import events as ev
    from nanovllm_core.sampling_params import SamplingParams

    text = " ".join(" ".join(chapter("paged_attention").paragraphs).split())
    assert "speculative decoding (chapter 12) is the exception" in text
    assert "reserves slots for 1 + k tokens" in text and "up to block_size - 1 + k empty slots" in text
    assert "without speculative decoding" in chapter("paged_attention").quiz.explanation
    k, bs = 4, 16
    engine = make_tiny_engine(speculative_model="ngram", num_speculative_tokens=k, block_size=bs)
    empty = []
    engine.subscribe(lambda e: empty.extend(len(t.block_table) * bs - t.num_computed_tokens for t in e.tables)
                     if isinstance(e, ev.BlocksChanged) else None)
    # 13 distinct prompt tokens: a decode at position 13 reserves 13..17, past block 0; sampled (seeded)
    # tokens rarely repeat, so the n-gram proposer often finds nothing to copy
    engine.add_request(list(range(20, 33)), SamplingParams(temperature=1.0, seed=0, max_tokens=10, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert max(empty) <= bs - 1 + k and max(empty) > bs - 1, empty  # the early block happened, within the bound


def test_the_tensor_parallel_chapter_tells_this_engines_rule_and_vllms_kv_head_replication():
    """Trial 12: "vLLM and nano-vllm split LLaMA the same way ... N must divide the number of KV heads", and the
    quiz's "at 12 a KV head is cut between ranks": vLLM runs 12 ranks over 4 KV heads, replicating each on 3."""
    from nanovllm_core.educational.tp_facts import valid_sizes

    ch = chapter("tensor_parallel")
    flat = " ".join(ch.text.split())
    assert "split LLaMA the same way" not in flat
    assert "In this engine each rank holds its own share of the KV heads" in flat
    assert "vLLM also accepts an N that is a multiple of the KV heads: it replicates each KV head" in flat
    assert "num_kv_head_replicas" in flat
    q = ch.quiz
    assert q.choices[q.answer] == "1, 2 and 4" and "this engine" in q.question
    assert valid_sizes(12, 4) == [1, 2, 4]  # what "this engine" means: engine/tp_facts' rule
    assert "At 12 this engine refuses, but vLLM accepts" in q.explanation
    # trial 13b: no KV head is cut, and engines refuse such an N by their checks, not by impossibility
    assert "At 3 or 6 some KV head's query heads would fall on two ranks" in q.explanation
    assert "vLLM and this engine both refuse such an N" in q.explanation


@pytest.mark.parametrize("number", [5, 6, 13])
def test_without_a_model_a_chapter_that_points_to_its_figures_says_they_are_not_shown(capsys, monkeypatch, tmp_path,
                                                                                    number):
    """Trial 27a: `nanovllm --tutorial --no-demos` printed chapter 5's "the figures below" and chapter 6's
    "the numbers below" and "the demonstration measures how much here", none of which came."""
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, "q\n", "--tutorial-chapter", str(number))
    assert code == 0
    flat = " ".join(out.split())
    assert "No model is loaded, so the figures and the demonstration this chapter refers to are not shown" in flat


def test_a_chapter_that_points_to_nothing_below_has_no_such_note(capsys, monkeypatch, tmp_path):
    code, out, _ = run_tutorial_cli(capsys, monkeypatch, tmp_path, "q\n", "--tutorial-chapter", "1")
    assert code == 0 and "No model is loaded" not in out


def _keys_through_a_terminal(keys: str) -> tuple[str | None, str]:
    """The one answer KeyInput reads from a real pseudo-terminal that was sent ``keys``, and what it echoed."""
    import os
    import pty
    import threading

    from rich.console import Console

    from nanovllm_core.educational.tutorial_view import KeyInput

    master, slave = pty.openpty()
    try:
        stream = os.fdopen(slave, "r", closefd=False)
        out = io.StringIO()
        # typed once the prompt waits: entering cbreak mode flushes input typed before it (TCSAFLUSH)
        typist = threading.Timer(0.3, os.write, (master, keys.encode()))
        typist.start()
        answer = KeyInput(stream).read("Your answer (A-D): ", Console(file=out, width=80, highlight=False))
        typist.join()
        return answer, out.getvalue()
    finally:
        os.close(master)
        os.close(slave)


def test_a_wrong_word_typed_at_the_quiz_is_one_wrong_answer_and_a_letter_acts_at_once():
    """Trial 28a: typing "hello" and Enter at the quiz printed "Please answer with A, B, C or D" six times
    (each key was an answer). A word is read to Enter and refused once; A-D and q still act at once."""
    answer, echoed = _keys_through_a_terminal("hello\n")
    assert answer == "hello" and "hello" in echoed, (answer, echoed)
    assert _keys_through_a_terminal("b") == ("b", "Your answer (A-D): b\n")
    assert _keys_through_a_terminal("xy\x7fz\n")[0] == "xz"  # Backspace edits the word
    assert _keys_through_a_terminal("\n")[0] == ""
    assert _keys_through_a_terminal("\x04")[0] is None  # Ctrl-D ends the tutorial


def test_the_verification_cost_says_when_the_host_was_busy(monkeypatch):
    """Trial 41e: on a busy host chapter 12 printed "v = 152.14 decode steps ... 0.02x" with no word that other work
    shared the CPU, where chapter 13's measurements say so."""
    from nanovllm_core.educational import speculative_costs, tutorial_demos

    busy = "warning: the host was busy (load average 5.0 on 2 cores at the end): other work shared the CPU"
    measured = speculative_costs.Measured(decode_s=0.0145, verify_s=2.2, draft_s=0.0001, gamma=4, mean_drafts=4.0,
                                          alpha=0.5, tokens_per_verify=1.9, plain_s_per_token=0.0565,
                                          spec_s_per_token=2.0)
    monkeypatch.setattr(speculative_costs, "measure", lambda *args, **kwargs: measured)
    for note, told in ((busy, True), (None, False)):
        monkeypatch.setattr(tutorial_demos, "HostCheck", lambda note=note: type("Check", (), {"note": lambda self: note})())
        demos = tutorial_demos.EngineDemos.__new__(tutorial_demos.EngineDemos)
        entry = demos._speculative_cost(DEMOS["speculative_decoding"], chapter("speculative_decoding").demo_prompt)
        assert ("Warning: the host was busy (load average 5.0 on 2 cores at the end)" in entry.text) is told, entry.text

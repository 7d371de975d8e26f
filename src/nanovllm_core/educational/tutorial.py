"""The tutorial: thirteen chapters on how a vLLM-class engine serves a prompt, each with a quiz.

This module is the single source of the tutorial's content. The CLI (``nanovllm --tutorial``)
and the Textual app's Tutorial tab both read :data:`CHAPTERS`, :data:`DEMOS`, :func:`grade`
and :class:`TutorialProgress` from here, so a learner sees the same words and questions in both.

The chapters follow the path of one request through the engine: text becomes token ids
(tokenization), rows of a matrix (embedding), mixes with its context (self-attention), is
read in one pass (prefill) whose keys and values are kept (KV cache), grows one token per
step (decode) drawn from a distribution (sampling), in memory organised as pages
(PagedAttention, Kwon et al. 2023), beside other requests (continuous batching, Yu et al.
2022 "Orca"), reusing what others already computed (prefix caching), under a per-step
budget with priorities (chunked prefill, Agrawal et al. 2023 "SARATHI"; preemption by
recompute, Kwon et al. 2023 section 4.5), several tokens per step (speculative decoding,
Leviathan et al. 2023; Chen et al. 2023), and finally one model split over several devices
(tensor parallelism, Shoeybi et al. 2019 "Megatron-LM" section 3).

Chapter text holds no numbers that claim to describe the loaded model: numbers about the
model come from :func:`model_facts` (computed from ``LLMEngine.model_info()``) and from the
live demonstrations, which run on the engine.

Why one long file: it is the tutorial's text (thirteen chapters, their quizzes and the facts each
chapter computes from the running engine), read top to bottom like the course it is; the code
around the text is small, and the demonstrations live in tutorial_demos.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanovllm_core.attention.fallbacks import FALLBACK_CONDITIONS, FLASH_ATTN_FALLBACK_CONDITIONS
from nanovllm_core.educational.commentary import human_bytes, ms, plural
from nanovllm_core.educational.xray_costs import (REMEASURE, UNRELIABLE, is_block, kernel_peak, peak_words, ridge_position,
                                                  unknown_peak_reason)
from nanovllm_core.model.block_formats import FORMATS  # torch-free
from nanovllm_core.sampling_params import SamplingParams
from nanovllm_core import untrusted

LETTERS = "ABCD"


@dataclass(frozen=True)
class Quiz:
    """A multiple-choice question: four ``choices`` shown as A-D, ``answer`` the right index (0..3)."""

    question: str
    choices: tuple[str, str, str, str]
    answer: int
    explanation: str


@dataclass(frozen=True)
class Chapter:
    """One chapter: ``number`` 1..13, a stable ``key``, the explanation ``text`` (paragraphs
    separated by blank lines), an optional live demonstration (``demo`` names an entry of
    :data:`DEMOS`; ``demo_prompt`` is the prompt it sends) and its ``quiz``."""

    number: int
    key: str
    title: str
    text: str
    demo: str | None
    demo_prompt: str | None
    quiz: Quiz

    @property
    def paragraphs(self) -> list[str]:
        """The text split at blank lines, each paragraph on one line."""
        return [" ".join(p.split()) for p in self.text.strip().split("\n\n") if p.strip()]


@dataclass(frozen=True)
class DemoRequest:
    """One request a demonstration sends: the prompt, its sampling settings and priority."""

    prompt: str
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True)
class Demo:
    """A live demonstration on the engine.

    Attributes:
        key: the name chapters use in ``Chapter.demo``.
        title: a short headline.
        watch: one sentence telling the learner what to look at.
        kinds: the narrator's ``Commentary.kind`` values worth showing for it (others are noise here).
        max_tokens: tokens generated per request (short on purpose: demos run on a CPU).
        xray: subscribe with ``xray=True`` (the embedding and attention demos need real layer values).
        extra_prompts: requests sent besides the chapter's ``demo_prompt``, in order.
        extra_max_tokens: ``max_tokens`` of each extra prompt (defaults to ``max_tokens``).
        priorities: one per request (the chapter's prompt first); empty means all 0.
        sequential: send each request only after the previous one finished (the prefix cache
            needs the first request's blocks to be computed before the second arrives).
        temperature, top_k, top_p, seed: sampling settings of every request.
        kv_every_step: narrate the KV cache after every step, even one that took no block (a
            demonstration that promises a figure per step shows it every step).
        engine: ``EngineConfig`` settings under which the effect shows on a fresh engine (the
            CLI builds a small engine with them; an app whose engine has other settings runs
            the requests as they are and the narrator reports what its settings produced).
        allreduce_ranks: before the requests, measure one all-reduce's latency across this many
            local processes (``educational/tp_measure.py``) and time a one-process decode for
            comparison (0: no measurement).
        app_watch: what the app's Tutorial tab shows instead of ``watch`` where it runs less than the
            command line (empty: the same); ``app_watch_split``: instead of that where the app's own
            engine is split over ranks (``{n}``: how many; empty: ``app_watch``), see :meth:`app_text`.
            Of an ``allreduce_ranks`` demonstration the tab runs the all-reduces and, where its own
            engine is one process, the one-process decode step, never the split run (see
            ``nanovllm_tui/views/tutorial.py``).
    """

    key: str
    title: str
    watch: str
    kinds: tuple[str, ...]
    max_tokens: int = 4
    xray: bool = False
    extra_prompts: tuple[str, ...] = ()
    extra_max_tokens: tuple[int, ...] = ()
    priorities: tuple[int, ...] = ()
    sequential: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    engine: tuple[tuple[str, Any], ...] = ()
    kv_every_step: bool = False
    allreduce_ranks: int = 0
    app_watch: str = ""
    app_watch_split: str = ""

    def app_text(self, split: int = 1) -> str:
        """What the app's Tutorial tab says this demonstration shows: ``app_watch_split`` (``{n}``: the ranks)
        where the app's own engine is split over ``split`` > 1 ranks and the demo has such words (trial 17b
        #3: the one-process words told a split app its split run "would start three more processes"), else
        ``app_watch``, else ``watch``."""
        if split > 1 and self.app_watch_split:
            return self.app_watch_split.format(n=split)
        return self.app_watch or self.watch

    def requests(self, prompt: str) -> list[DemoRequest]:
        """The requests to send, in order: ``prompt`` (the chapter's ``demo_prompt``) then the extras."""
        prompts = (prompt, *self.extra_prompts)
        budgets = (self.max_tokens, *self.extra_max_tokens)
        budgets += (self.max_tokens,) * (len(prompts) - len(budgets))
        priorities = self.priorities or (0,) * len(prompts)
        return [
            DemoRequest(p, SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                          seed=self.seed, max_tokens=n, ignore_eos=True), prio)
            for p, n, prio in zip(prompts, budgets, priorities)
        ]

    def engine_settings(self) -> dict[str, Any]:
        return dict(self.engine)


def _or_words(items: tuple[str, ...]) -> str:
    return ", ".join(items[:-1]) + ", or " + items[-1] if len(items) > 1 else "".join(items)


# When attention gathers (the conditions are the kernels' own lists, not restated here).
_GATHER_WHEN = (f"That happens on the CPU with {_or_words(FALLBACK_CONDITIONS)}; and on a GPU with "
                f"--no-flash-attn or where flash-attn's paged kernel refuses the cache: "
                f"{_or_words(FLASH_ATTN_FALLBACK_CONDITIONS[1:])}.")


# A long, plain prompt for the chunked-prefill demonstration (about a hundred tokens).
_LONG_PROMPT = (
    "A river begins as rain on a mountain. The water gathers in small streams, the streams join into "
    "brooks, and the brooks meet in a valley where they become a river. The river carries sand and stones "
    "down towards the plains, where it slows, bends and spreads out. Near the sea it splits into many "
    "channels and drops the sand it carried, building a delta. Summarise this in one sentence:"
)
# Shared by the two prefix-caching requests: long enough to fill at least two 16-token blocks.
_SHARED_PREFIX = (
    "You are a patient teacher for curious children. You answer in one short sentence, using plain words "
    "a child would understand, never more than twenty words, and you never use jargon. Question: "
)

DEMOS: dict[str, Demo] = {d.key: d for d in (
    Demo("tokenization", "A prompt as token ids",
         "Each piece of text and the integer the model receives for it.",
         kinds=("tokenization",), max_tokens=1),
    Demo("embedding", "Token ids become vectors",
         "The size of each token's vector and a few of its real values from layer 0's input.",
         kinds=("embedding",), max_tokens=1, xray=True),
    Demo("attention", "Attention inside one layer",
         "The shapes of Q, K and V, the score matrix, and how the query heads share fewer KV heads.",
         kinds=("embedding", "attention"), max_tokens=1, xray=True),
    Demo("prefill", "The prompt in one forward pass",
         "How many tokens one step processed at once, how long it took, and its FLOP per byte against "
         "this machine's measured ridge point.",
         kinds=("prefill", "decode", "roofline"), max_tokens=1, xray=True),
    Demo("kv_cache", "The cache grows one token at a time",
         "After each step: the bytes the request's blocks reserve, the bytes its tokens store, and the "
         "blocks behind them.",
         kinds=("prefill", "kv_cache"), max_tokens=6, kv_every_step=True),
    Demo("decode", "One token per step",
         "The five most likely next tokens at each step, and the one the engine took.",
         kinds=("decode",), max_tokens=5),
    Demo("sampling", "Temperature and top-k at work",
         "Sampling at temperature 0.9 among the 20 best tokens: the chosen token is not always the top one.",
         kinds=("sampling", "decode"), max_tokens=5, temperature=0.9, top_k=20, seed=7),
    Demo("paged_attention", "Block tables",
         "Which physical blocks each request received, and how many slots stay unfilled.",
         kinds=("prefill", "kv_cache"), max_tokens=3,
         extra_prompts=("Name three colours of the rainbow:",)),
    Demo("continuous_batching", "Requests join as others leave",
         "With room for two running requests, the third waits and joins at the step after one finishes.",
         kinds=("scheduler", "finished"), max_tokens=2,
         extra_prompts=("The largest planet is", "Python is a"), extra_max_tokens=(6, 4),
         engine=(("max_num_seqs", 2),)),
    Demo("prefix_caching", "A shared prefix is computed once",
         "The second request finds the shared opening's full blocks in the cache and computes only the rest.",
         kinds=("prefix_cache", "prefill", "scheduler"), max_tokens=2, sequential=True,
         extra_prompts=(_SHARED_PREFIX + "Why do leaves fall in autumn?",),
         engine=(("block_size", 16),)),
    Demo("chunked_prefill", "A long prompt in chunks, and an urgent request",
         "The long low-priority prompt is read in chunks within the step budget; the high-priority "
         "request goes first, and when blocks run short a lower-priority request is preempted.",
         kinds=("scheduler", "chunked_prefill", "preemption", "prefill", "finished"), max_tokens=6,
         extra_prompts=("Quick: the capital of Italy is",), extra_max_tokens=(6,), priorities=(0, 10),
         engine=(("max_num_batched_tokens", 32), ("block_size", 8), ("num_kv_blocks", 12))),
    Demo("speculative_decoding", "Drafts checked in one pass",
         "The n-gram proposer drafts up to 4 tokens from the text so far; the model runs them with its newest "
         "token in one forward pass, keeps each draft while it equals its own greedy choice, and adds one "
         "token of its own.",
         kinds=("speculative", "finished", "speculative_cost"), max_tokens=8,
         engine=(("speculative_model", "ngram"), ("num_speculative_tokens", 4))),
    Demo("tensor_parallel", "All-reduces measured here, and the model split over 3 ranks",
         "How long one all-reduce takes between processes on this machine, what a token's all-reduces cost at "
         "that speed beside a one-process decode step measured now, and, where this build's engine splits a "
         "model, the same prompt at N = 3 with each step's time in all-reduces.",
         kinds=("communication", "decode"), max_tokens=4, engine=(("tensor_parallel_size", 3),),
         allreduce_ranks=3,
         app_watch="How long one all-reduce takes between processes on this machine, and what a token's "
         "all-reduces cost at that speed beside a one-process decode step timed now over the loaded model (where "
         "this app's own engine is one process). The model split over 3 ranks is not run here: it would start "
         "three more processes, each loading its shard of the model, beside this app's engine while it serves "
         "you; `nanovllm --tutorial --tutorial-chapter 13` in a terminal runs it.",
         app_watch_split="How long one all-reduce takes between processes on this machine, and what a token's "
         "all-reduces cost at that speed. This app's own engine is already the model split over {n} ranks: its "
         "Dashboard, X-Ray and Narrator show every rank as you send prompts. No one-process decode step is timed "
         "beside the all-reduces: what is loaded here is rank 0's shard, not the whole model; "
         "`nanovllm --tutorial --tutorial-chapter 13` in a terminal prints that comparison."),
)}
# Repeats itself, so prompt lookup has drafts to offer: the first are kept, a later one is not.
_SPECULATIVE_PROMPT = "Copy the list: red, green, blue, yellow. Copy: red, green, blue, yellow. Copy: red,"


# How a demonstration's own engine setting reads in its heading (``Demo.engine``).
_SETTING_WORDS = {
    "max_num_batched_tokens": lambda v: f"a budget of {v} tokens a step",
    "block_size": lambda v: f"blocks of {v} tokens",
    "num_kv_blocks": lambda v: f"{v} KV blocks",
    "max_num_seqs": lambda v: f"at most {v} requests running",
    "speculative_model": lambda v: f"{v} drafts",
    "num_speculative_tokens": lambda v: f"up to {v} drafted tokens a step",
    "tensor_parallel_size": lambda v: f"the model split over {v} ranks",
}


def demo_engine_words(demo: Demo) -> str:
    """The settings a demonstration sets on its own engine, in words (``""`` when it sets none):
    ``"a budget of 32 tokens a step, blocks of 8 tokens, 12 KV blocks"``. Its numbers depend on them,
    so the heading states them before the demo runs (trial 10: chapter 11's facts gave the loaded
    engine's 512-token budget and its demo ran with 32, 8-token blocks and 12 blocks unsaid)."""
    return ", ".join(_SETTING_WORDS[k](v) if k in _SETTING_WORDS else f"{k} {v}" for k, v in demo.engine)


def engine_settings_text(info: dict[str, Any], speculator: str = "", k: int = 0) -> str:
    """A demonstration engine's settings that shape its numbers, from its ``model_info()``:
    ``"12 KV blocks of 8 tokens, budget 32 tokens a step, at most 256 running, priority policy"``,
    then ``", ngram drafts of up to 4 tokens"`` when ``speculator`` names its proposer. Shown by the
    CLI and the app when a demonstration starts. Raises KeyError when ``info`` lacks a size."""
    parts = [f"{info['num_kv_blocks']} KV blocks of {info['block_size']} tokens",
             f"budget {info['token_budget']} tokens a step", f"at most {info['max_num_seqs']} running",
             f"{info['scheduling_policy']} policy"]
    text = ", ".join(parts)
    if speculator:
        text += f", {speculator} drafts of up to {k} tokens"
    return text


def demo_heading(ch: Chapter, app: bool = False) -> str:
    """The line that announces a chapter's demonstration: its title, the fixed prompt it sends, so a
    learner who typed a prompt of their own is not told the demo shows theirs, and the settings of its
    own engine where it sets any (:func:`demo_engine_words`). ``app``: the app's Tutorial tab, which
    runs no engine for an ``allreduce_ranks`` demonstration (its measurement only): the title alone.
    Raises KeyError when the chapter has no demonstration."""
    demo = DEMOS[ch.demo]
    if app and demo.allreduce_ranks:
        return "All-reduces measured here"
    engine = demo_engine_words(demo)
    own = f"on a small engine of its own with {engine}" if engine else ""
    if not ch.demo_prompt:
        return f"{demo.title} ({own})" if own else demo.title
    which = "fixed prompts" if demo.extra_prompts else "fixed prompt"
    shown = f" {ch.demo_prompt!r}" if len(ch.demo_prompt) <= 40 else ""
    first = ", the first" if demo.extra_prompts and shown else ""
    return f"{demo.title} (on its own {which}{shown}{first}; not one you typed{'; ' + own if own else ''})"


def _quiz(question: str, choices: tuple[str, str, str, str], answer: int, explanation: str) -> Quiz:
    return Quiz(question, choices, answer, explanation)


CHAPTERS: tuple[Chapter, ...] = (
    Chapter(
        1, "tokenization", "Tokenization: text becomes numbers",
        """
        A language model never sees letters. Before anything else, a tokenizer cuts the prompt into
        pieces taken from a fixed vocabulary and replaces each piece by its number in that vocabulary,
        its token id. LLaMA-family models use byte-pair encoding (BPE): frequent words are a single
        piece, rare words are spelled out of several smaller pieces, and a leading space usually
        belongs to the piece that follows it.

        The list of ids is the real input. Its length, counted in tokens and not in characters, is
        what costs compute in every layer and what occupies memory in the KV cache, so an engine
        measures prompts, budgets and limits in tokens.

        Chat models wrap a conversation in special tokens (the chat template) that mark who is
        speaking; those are ids like any other.
        """,
        "tokenization", "The capital of France is",
        _quiz("Why does an inference engine measure a prompt's length in tokens rather than characters?",
              ("Tokens take less disk space than characters",
               "Each token is one position the model computes and one entry it keeps in the KV cache",
               "Python strings cannot hold more than a few thousand characters",
               "Accelerators can only add integers"),
              1,
              "Every token id becomes one row of activations in each layer and one key/value pair per layer "
              "in the cache. Compute time, memory and the scheduler's budget all scale with the number of "
              "tokens; characters play no part once the text is tokenized."),
    ),
    Chapter(
        2, "embedding", "Embedding: ids become vectors",
        """
        The first layer of the model is a table with one row per vocabulary entry, the embedding
        matrix of shape [vocab_size, hidden_size]. Token id i simply selects row i: there is no
        arithmetic, only a lookup. A prompt of N tokens becomes a matrix of shape [N, hidden_size],
        the hidden states that every decoder layer reads and refines. In a step of this engine the
        rows of every request in the batch are stacked into one [T, hidden_size] matrix for the T
        tokens of the step, so each matrix multiplication serves them all at once.

        The values in the table were learned in training; tokens used in similar ways ended up with
        similar rows. LLaMA adds no position vector here: position enters later, inside attention,
        where rotary embeddings (RoPE) turn each query and key by an angle that depends on its position.

        Many small models tie the embedding to the output: the same matrix, used the other way round,
        turns the last hidden state back into one score per vocabulary entry.
        """,
        "embedding", "The capital of France is",
        _quiz("What does the embedding step compute for token id 504?",
              ("A dot product between 504 and every weight of the model",
               "A softmax over the vocabulary",
               "Nothing but a lookup: it takes row 504 of the embedding matrix",
               "A fresh random vector for every request"),
              2,
              "The embedding is a table lookup. Row 504 of the [vocab_size, hidden_size] matrix is the vector "
              "for token 504; the learning happened in training, not at inference time."),
    ),
    Chapter(
        3, "self_attention", "Self-attention: tokens read each other",
        """
        In every layer each token produces three vectors by multiplying its hidden state with learned
        matrices: a query Q (what it is looking for), a key K (what it offers) and a value V (what it
        passes on). The scores S = Q K^T / sqrt(head_dim) say how well each query matches each key;
        a softmax turns each row of scores into weights that sum to 1, and the output is those weights
        times the values, O = P V.

        The causal mask removes the scores of keys that come after the query, so a token only uses the
        text before it, exactly as when it was generated. The work is split over several heads that
        attend in parallel, each over its own slice of head_dim numbers.

        Grouped-query attention (GQA) lets several query heads share one key/value head. The model
        still asks as many questions, but it stores fewer keys and values per token, which shrinks the
        KV cache by the ratio of query heads to KV heads. Nothing is copied to make this work: query
        head h reads KV head h // g, where g is the number of query heads per KV head.
        """,
        "attention", "The capital of France is",
        _quiz("Why does a token's attention ignore the positions that come after it?",
              ("Later tokens do not exist yet when a token is generated, so the model is trained without them (the causal mask)",
               "To keep the score matrix square",
               "Because softmax cannot handle more than a few keys",
               "To halve the size of the KV cache"),
              0,
              "Generation writes text left to right: when a token is produced, nothing after it exists. Training "
              "masks the future the same way, so at inference each token's scores cover only itself and earlier tokens."),
    ),
    Chapter(
        4, "prefill", "Prefill: reading the prompt in one pass",
        """
        The first step for a new request is the prefill: all the prompt's tokens go through the model
        together. Because the whole prompt is known, every position can be computed at once, as large
        matrix multiplications of shape [N, hidden] by [hidden, ...]. Each weight read from memory then
        serves N tokens' arithmetic, so the arithmetic intensity (FLOPs per byte moved) grows with N. A
        step is limited by compute only once that intensity passes the machine's ridge point, its peak
        FLOP/s divided by its memory bandwidth; below it, a short prompt's prefill is still limited by
        memory. The X-Ray measures this machine's ridge point and shows each operation's intensity.

        Prefill writes the keys and values of all N prompt tokens into the KV cache. Only the last
        position's hidden state is turned into vocabulary scores, because only the token after the
        prompt is being predicted; the others were given.

        The time from a request's arrival to its first generated token is the time to first token
        (TTFT). A long prompt makes a long prefill, and while it runs, the requests already decoding
        wait for their next token; chapter 11 shows how engines split a prompt into chunks.
        """,
        "prefill", "The capital of France is",
        _quiz("Prefilling a 200-token prompt, how many positions' vocabulary scores does the engine need "
              "to choose the first new token?",
              ("All 200", "Half of them, 100", "None: prefill does not produce a token", "Only the last position's"),
              3,
              "The next token follows the last prompt token, so only that position's hidden state goes through "
              "the LM head. The other 199 positions still run through every layer, because their keys and values "
              "are needed in the cache."),
    ),
    Chapter(
        5, "kv_cache", "The KV cache: never compute a key twice",
        """
        A token's key and value in a given layer depend only on the tokens up to it, so once computed
        they never change. The engine stores them in the KV cache. At each later step only the new
        token's query, key and value are computed; its query is compared against all the cached keys.

        Without the cache, generating the t-th token would mean running all t earlier tokens through
        the model again: t tokens' projections and MLP (work proportional to t) and their causal
        attention (t(t+1)/2 query-key pairs) at every step, so n tokens would cost about n^2/2 tokens'
        projections and n^3/6 pairs in all. With the cache, each step does one token's projections
        and MLP (a constant) and compares one query with t cached keys (work that grows linearly with
        t): n tokens cost n tokens' projections and about n^2/2 pairs. At short contexts the constant
        part dominates; the figures below derive, for this model, where attention overtakes it.

        The price is memory. One token needs 2 (K and V) x layers x KV heads x head_dim numbers, times
        the bytes per number. For long sequences and many requests this cache can outgrow the weights
        themselves, and managing it well is what the next chapters are about.
        """,
        "kv_cache", "Once upon a time",
        # Not the bytes per token itself: the figures right above the quiz print this model's (issue 29).
        _quiz("A model has 30 layers whose 9 query heads share 3 KV heads of head_dim 64, and stores float32 "
              "(4 bytes). Without grouped-query attention (one KV head for each of the 9 query heads), how many "
              "bytes of KV cache would one token take?",
              ("15,360", "46,080", "138,240", "276,480"),
              2,
              "2 (K and V) x 30 layers x 9 KV heads x 64 x 4 bytes = 138,240 bytes, 3 times the 46,080 of the 3 "
              "shared KV heads: grouped-query attention cuts the cache by the group size. 15,360 is one KV head "
              "for all 9 query heads (multi-query attention); 46,080 keeps the 3 shared heads; 276,480 counts "
              "8 bytes a number, not float32's 4."),
    ),
    Chapter(
        6, "decode", "Decode: one token per step",
        """
        After the prefill, the request generates one token per engine step. The input of a decode step
        is a single token: its hidden state passes through every layer, its query attends over the
        cached keys, its key and value are appended, and the last layer's output becomes scores over
        the vocabulary.

        One token is little arithmetic for the amount of weight data that must be read from memory:
        each weight read serves one multiply-add, 2 FLOPs over the bytes it takes, so its arithmetic
        intensity is low. Where it is below the ridge point of the kernel that multiplies the weights
        (as on GPUs), reading the weights sets a floor under a lone decode step's time that no faster
        arithmetic can lower; where it is near that ridge point, the arithmetic takes about as long as
        the reading. The figures below place it for this model and this machine, each weight format
        against its own kernel's measured ridge point. On a GPU that floor is most of the step; on a
        CPU the step can take many times the floor, spent on per-call and Python overhead (the
        demonstration measures how much here). Batching many requests' decode
        tokens into one step shares that weight read: every weight loaded serves every token of the
        batch. It does not share the reads of the KV cache: each request's query reads its own cached
        keys and values, bytes that grow with its context and that no batching reduces.

        Storing each weight in fewer bytes (GGUF's blocks: 32 weights and their fp16 scale in
        34 bytes for Q8_0, 18 for 4-bit Q4_0, 20 for Q4_1 with a min as well) lowers the bytes a step
        reads, and with them the floor that the memory bandwidth puts under its time. The step is only as
        much faster when nothing else takes the time: the norms, RoPE, the KV write, attention and every
        call from Python into a kernel stay as they were, so once the weights shrink they can be much of
        the step. The numbers below are this engine's, in the mode it runs.

        The time between successive tokens is the time per output token (TPOT, also inter-token
        latency). Decoding stops at an end-of-sequence token (unless ignore_eos is set), a stop token
        or stop string, max_tokens, or the model's maximum length.
        """,
        "decode", "The capital of France is",
        _quiz("Why is reading the weights, not the arithmetic, the floor under a single request's decode step?",
              ("It must read every weight of the model to compute just one token",
               "It recomputes the whole prompt at every step",
               "The softmax over the vocabulary needs more memory than the weights",
               "Decode runs on the CPU while prefill runs on the accelerator"),
              0,
              "Each weight read from memory is used for one multiply-add per token in the batch. With one token, "
              "that is 2 FLOPs for each weight's bytes, an intensity below the ridge point of most machines and "
              "kernels (the figures above place it for this one), so loading the weights takes longer than their "
              "arithmetic (what else the step spends, such as per-call overhead on a CPU, comes on top); batching "
              "many requests' decode tokens reuses every loaded weight many times, while each request still "
              "reads its own keys and values."),
    ),
    Chapter(
        7, "sampling", "Sampling: choosing the next token",
        """
        The model's last layer gives one score (logit) per vocabulary entry; a softmax turns them into
        probabilities. Greedy decoding takes the token with the highest score, which is deterministic
        and the reference mode for testing.

        Temperature divides the logits before the softmax: below 1 it sharpens the distribution towards
        the favourite, above 1 it flattens it. Min-p drops tokens whose probability is below min_p times
        the best one's; top-k keeps only the k most likely tokens; top-p (nucleus) keeps the smallest set
        of most likely tokens whose probabilities add up to at least p. This engine applies them in that
        order, after temperature, as vLLM does. What survives is renormalised and one token is drawn from
        it. A seed makes the draw repeatable.

        Penalties lower the scores of tokens already used, to avoid loops: the repetition penalty covers
        the prompt and the output, presence and frequency penalties only the output. They act first,
        before temperature, and under greedy decoding too: greedy then takes the best token after the
        penalty, which need not be the model's own favourite.
        """,
        "sampling", "My favourite fruit is",
        _quiz("What does a temperature of 0.5 do to the next-token distribution?",
              ("Halves every probability",
               "Sharpens it: the likely tokens become even more likely",
               "Flattens it: all tokens become about equally likely",
               "Keeps only the best half of the vocabulary"),
              1,
              "Dividing the logits by 0.5 doubles the gaps between them, and the softmax turns bigger gaps into a "
              "more peaked distribution. Temperatures above 1 shrink the gaps and flatten it."),
    ),
    Chapter(
        8, "paged_attention", "PagedAttention: the cache in blocks",
        """
        Reserving one long contiguous region per request for its maximum length can waste most of it:
        requests end early, and the space cannot be lent to others. PagedAttention (the vLLM paper)
        borrows the idea of virtual memory pages. The cache is a pool of fixed-size blocks, each holding
        the keys and values of block_size tokens.

        Each request has a block table that maps its logical blocks (tokens 0..15, 16..31, ...) to
        physical blocks anywhere in the pool. A new block is taken only when the last one is full, so a
        request wastes at most the unfilled slots of its last block; speculative decoding (chapter 12)
        is the exception. Before each of its steps the scheduler reserves slots for 1 + k tokens, the
        newest and up to k drafts, taking a block early when they cross the last one's end. The
        verification gives back blocks past the tokens it keeps; when the proposer drafted nothing,
        nothing is rolled back and the early block waits for the tokens to come, so between steps a
        request may hold up to block_size - 1 + k empty slots. The slot mapping tells the model
        where to write each new token's key and value. To read them back, this engine's CPU kernel (a
        short C file, attention/paged_attention_cpu.c) walks each query token's context through the
        block table, key by key, reading every block in place; so do vLLM's PagedAttention kernels
        and the flash-attn paged kernel this engine uses on CUDA with 256-token blocks. Where neither
        runs, the engine first gathers a sequence's blocks,
        in block-table order, into one contiguous buffer per layer and attends over that copy: every
        cached number is then read, written and read again. """ + _GATHER_WHEN + """

        Because blocks carry a reference count, two sequences can point at the same physical block.
        Prefix caching (chapter 10) relies on it, and so do parallel samples (n > 1): here the samples
        share their prompt's full blocks through the prefix cache, and each computes the block that
        holds the prompt's last token itself. The PagedAttention paper's engine shares even that
        partial block between samples and copies it on write, when a sample first adds a token to it.
        """,
        "paged_attention", "The capital of France is",
        _quiz("With block_size 16, a request holds 35 tokens. How many blocks does it use, and how many slots "
              "are reserved but unfilled?",
              ("2 blocks, 0 unfilled", "35 blocks, 0 unfilled", "3 blocks, 16 unfilled", "3 blocks, 13 unfilled"),
              3,
              "35 tokens need ceil(35 / 16) = 3 blocks = 48 slots, of which 48 - 35 = 13 wait for future tokens. "
              "Blocks are taken on demand, so without speculative decoding the waste is never more than one "
              "block per request."),
    ),
    Chapter(
        9, "continuous_batching", "Continuous batching: scheduling every step",
        """
        A static batch starts together and ends together: a request that finishes early leaves its
        place empty until the longest one is done. Continuous batching, introduced by Orca as
        iteration-level scheduling, decides the batch again at every step.

        Each step the scheduler first serves the running requests (a decode costs one token, an
        unfinished prefill its next chunk), then admits waiting requests, in the policy's order, while
        three things last: the token budget of the step, the limit on running requests (max_num_seqs),
        and free KV blocks. Once a step has preempted a request, it admits nobody after that (under the
        priority policy the request that caused the preemption may itself be the one admitted, chapter
        11). Prefill chunks and decodes share one forward pass.

        A request that finishes gives back its place and its blocks at once (a block another request
        shares through the prefix cache stays in use by it), and the next waiting request
        joins at the following step.
        """,
        "continuous_batching", "The capital of France is",
        _quiz("In a running batch, one request finishes much earlier than the others. What happens at the "
              "next step with continuous batching?",
              ("The batch keeps the empty place until every request is done",
               "All the other requests are restarted",
               "A waiting request is admitted into the freed place",
               "The engine pauses until a new batch can be formed"),
              2,
              "The scheduler re-plans every step. The finished request's place and blocks are released (a block "
              "another request shares stays in use), and a "
              "waiting request is admitted at the next step if the budget, max_num_seqs and the free blocks "
              "allow."),
    ),
    Chapter(
        10, "prefix_caching", "Prefix caching: reuse what was computed",
        """
        Many requests start the same way: a system prompt, a few-shot example, an earlier turn of a
        chat. Their keys and values for that shared opening are identical, so computing them again is
        wasted work.

        The block manager gives each full block a hash of its tokens chained with the hash of the block
        before it, so equal hashes mean equal prefixes up to that point. When the scheduler admits a
        request, its prompt's full blocks are looked up; every hit is shared by reference count instead of being
        computed, and the prefill starts after the cached part. Only full blocks are cached, and a hit
        never includes the block that holds the prompt's last token: sampling needs that token's scores,
        so its block is computed again even when it is cached (a whole block when the prompt ends
        exactly at a block boundary).

        A freed block keeps its hash in a least-recently-used list until its space is needed, so a
        prefix can be reused even after the request that computed it has finished.
        """,
        "prefix_caching", _SHARED_PREFIX + "Why is the sky blue?",
        _quiz("Two prompts share their first 40 tokens and the block size is 16. How many of the second "
              "prompt's tokens can come from the prefix cache?",
              ("32", "40", "16", "0, because the prompts differ"),
              0,
              "Only full blocks are cached: the first two blocks (tokens 0-31) are identical and hit. The third "
              "block mixes shared and different tokens, so its hash differs and it is computed."),
    ),
    Chapter(
        11, "chunked_prefill", "Chunked prefill, priority and preemption",
        """
        A very long prompt would take a whole step, or several steps' worth of time, during which
        every other request waits for its next token. Chunked prefill (SARATHI) splits the prompt into
        chunks that fit the per-step token budget. Each step the scheduler walks the running requests
        in order, under the priority policy the most important first, under fcfs in the order they were
        admitted: a decode takes one token of the budget, an unfinished prompt its next chunk, as much
        of what is left as it can use. A long prompt therefore never takes more than one budget a step
        and the requests served before it keep decoding; a request served after a chunk that used the
        whole budget gets no token in that step. With speculative decoding (chapter 12) a decode takes
        1 + k tokens of the budget, its newest token and k draft slots, reserved before the proposer
        drafts; slots the proposer leaves empty go to no one in that step, so a chunk can be cut
        shorter than the tokens the step runs would suggest (vLLM V1 drafts at the end of the step
        before and budgets exactly 1 + the drafts).

        With the priority policy, requests are served and admitted in order of priority, then arrival.
        In this engine a higher priority value is more important; vLLM's convention is the opposite
        (lower values run first), and its default policy is fcfs. When a running request needs more KV
        blocks than are free (a decode needs one when its last block is full, a chunk may need several
        while a few are still free), the engine preempts: the running request with the lowest priority, and the latest arrival among equals,
        gives back all its blocks and returns to the waiting queue. It keeps its tokens, the prompt and
        any it generated; when it is readmitted, the full blocks of those tokens that are still in the
        prefix cache are reused, and only the rest is computed: recomputed where it had computed them, for
        the first time where not. A request preempted while decoding never ran its newest token, sampled
        just before the preemption; one preempted in the middle of its prefill, as in the demo below, never
        ran the prompt tokens its prefill had not reached. Here a waiting high-priority request may also
        preempt lower-priority ones to get in, as vLLM V0 did; vLLM V1 does not: its waiting request waits until blocks
        free up, and only a running request that needs blocks preempts.

        Preemption trades some recomputation for never running out of memory in the middle of a step.
        """,
        "chunked_prefill", _LONG_PROMPT,
        _quiz("Under the priority policy, when KV blocks run out, which running request is preempted?",
              ("The one that has generated the most tokens",
               "The one that arrived first",
               "A random one",
               "The lowest-priority one, and among equals the latest to arrive"),
              3,
              "The victim is the least important running request: lowest priority first, then latest arrival. Its "
              "blocks are released (a block another request shares stays in use), it goes back to the waiting "
              "queue with its generated tokens, and when readmitted it reuses what the prefix cache still holds "
              "of them and recomputes the rest."),
    ),
    Chapter(
        12, "speculative_decoding", "Speculative decoding: several tokens per step",
        """
        At batch 1 a decode step reads every weight of the model to produce one token. Running a few
        more tokens through the same pass reads the weights once for all of them, so where a step is
        bound by reading weights (a GPU at small batch), verifying several tokens costs little more
        than producing one; where the arithmetic shows (a CPU), each extra token adds to the step, and
        the command line's demonstration (nanovllm --tutorial) times it on this machine. Speculative decoding exploits this: a cheap proposer (a small
        draft model, or an n-gram lookup in the text so far) guesses the next k tokens, and the target
        model runs 1 + k tokens (the last one it kept and the k drafts) in a single forward pass,
        which gives it its own next-token scores at all k + 1 positions.

        Each draft token x is accepted with probability min(1, p(x) / q(x)), where p is the target's
        probability and q the draft's. At the first rejection the target samples a replacement from
        the leftover distribution max(0, p - q), renormalised; if all k are accepted it adds one bonus
        token of its own. This rule makes the output follow the target model's distribution exactly.
        An n-gram guess is a fixed token (q = 1), so it is kept with probability p. Greedy requests use
        the rule's limit: a draft is kept while it equals the target's own highest-scoring token, and
        at the first mismatch the target's token replaces it, so the text is exactly what greedy
        decoding without speculation writes (bit for bit on this engine's default CPU attention kernel;
        other attention paths score the drafts in other matrix shapes, equal up to float rounding).

        The speed-up depends on the acceptance rate alpha (the chance that the target keeps a draft),
        the number of drafts gamma, and two costs. Leviathan et al. (2023, Theorem 3.8): a step yields
        (1 - alpha^(gamma+1)) / (1 - alpha) tokens on average, and the expected speed-up is that divided
        by (gamma c + 1), where c is the drafter's cost per draft in target steps and the 1 is the
        verification, counted as one target step. Where verifying 1 + gamma tokens costs v target steps,
        divide by (gamma c + v) instead: with v large enough, speculation is slower than plain decoding.
        """,
        "speculative_decoding", _SPECULATIVE_PROMPT,
        _quiz("Why does speculative decoding not change the distribution of the generated text?",
              ("Because the draft model is a copy of the target",
               "Because the accept/reject rule with the residual resampling reproduces the target's distribution",
               "Because rejected tokens are kept but marked",
               "It does change it, slightly, in exchange for speed"),
              1,
              "Accepting x with probability min(1, p/q) and resampling rejections from max(0, p - q) is rejection "
              "sampling: the combined result is distributed exactly as p, whatever the draft proposes (under "
              "greedy decoding, drafts are kept only while they equal the target's choice). A poor draft only "
              "lowers the acceptance rate, and so the speed-up."),
    ),
    Chapter(
        13, "tensor_parallel", "Tensor parallelism: one model over several devices",
        """
        When a model outgrows one device, or one device is too slow for it, tensor parallelism splits
        every layer's matrices over N devices, the ranks. Each rank holds a slice of every weight and of
        the KV cache, and all ranks run every layer at the same time on the same tokens. Megatron-LM
        (Shoeybi et al. 2019, section 3) arranges the slices so that a decoder layer needs only two
        exchanges between the ranks. vLLM and this engine split LLaMA's layers that way; they differ
        only in which N they accept when KV heads are few (below).

        The projections into attention and into the MLP (q, k, v, gate and up) are column-parallel:
        each rank keeps a slice of their output features, its query heads with the KV heads they read
        and its share of the MLP's intermediate features, and computes its part of attention and of
        SiLU(G) * U without talking to anyone. The projections back (o and down) are row-parallel: each
        rank multiplies its slice by the matching rows and gets a full-width [T, hidden] partial sum.
        (Rows and columns here are of W in Y = X W, W being [in, out]; PyTorch stores a weight as
        [out, in], so in the code and docs/engine.md the same slices are the other way round.)
        One all-reduce after each (every rank contributes its sum and receives the total) gives all
        ranks the layer's output: two all-reduces per layer. The embedding and the LM head are split
        over the vocabulary: each rank looks up only the ids in its rows and one more all-reduce adds
        the lookups; each rank's slice of the logits is gathered on rank 0, which samples. A step
        therefore runs 2 x layers + 1 all-reduces of a [T, hidden] tensor, one after another, because
        each layer needs the previous one's sum.

        Grouped-query attention bounds N. Query head h reads KV head h // g, so the rank that computes
        query head h must hold that KV head's keys and values in its own cache, whole. In this engine
        each rank holds its own share of the KV heads and the query heads that read them, so N must
        divide the number of KV heads (then it divides the query heads too); it must also divide the
        intermediate size (each rank's MLP features) and the vocabulary (each rank's rows of the
        embedding and the LM head). Each rank's KV cache then holds only its KV heads: per token,
        2 (K and V) x layers x (KV heads / N) x head_dim numbers, a 1/N share of the whole cache.
        vLLM also accepts an N that is a multiple of the KV heads: it replicates each KV head on
        N / KV-heads ranks (QKVParallelLinear's num_kv_head_replicas), so every rank still holds a
        whole KV head for its query heads, and those ranks store the same keys and values, a cache
        that is not split further. An N that neither divides the KV heads nor is a multiple of them,
        vLLM and this engine both refuse (their divisibility checks): over 2 ranks, a model whose 9 query
        heads share 3 KV heads would split its query heads unevenly (5 and 4), and KV head 1, read by
        query heads 3, 4 and 5, would be needed whole on both ranks. No KV head is ever cut in half; an
        engine would have to copy that one to both, which neither does.

        On separate GPUs each rank brings its own arithmetic and memory bandwidth, so a decode step
        that waits on reading weights reads a third of them on each of 3 devices at once, and an
        all-reduce over NVLink takes a few microseconds. On one CPU none of that holds: the ranks are
        processes sharing the same cores and the same memory bandwidth, so together they read the
        same bytes through the same memory as one process would (of the same weights: this engine
        splits float layers only, so over a GGUF file the ranks read its weights as floats, more bytes
        than one process reading the file's blocks), and each all-reduce is a handshake
        between processes through the operating system (gloo over 127.0.0.1) that costs tens to hundreds
        of microseconds, more on a busy machine. A decode token waits for all 2 x layers + 1 of them in
        turn, so on one CPU the split engine is slower than one process; the demonstration measures by
        how much communication alone costs here.
        """,
        "tensor_parallel", "The capital of France is",
        _quiz("A model has 12 query heads sharing 4 KV heads. Over which numbers of ranks can this engine "
              "split its attention?",
              ("1, 2, 3, 4, 6 and 12", "1, 2 and 4", "Only 1 and 4", "Any number up to 12"),
              1,
              "In this engine each rank holds its share of whole KV heads together with the query heads that read "
              "them, so N must divide the 4 KV heads: 1, 2 or 4 (each of which also divides the 12 query heads). "
              "At 3 or 6 some KV head's query heads would fall on two ranks, so that whole KV head would be needed on "
              "both; vLLM and this engine both refuse such an N (their divisibility checks). At 12 this "
              "engine refuses, but vLLM accepts: 12 is a multiple of 4, so it replicates each KV head on 3 ranks "
              "(num_kv_head_replicas = 12 / 4) and each rank holds 1 query head with a whole copy of its KV head "
              "(the MLP's intermediate size must still divide by 12)."),
    ),
)


def chapter(key: str) -> Chapter:
    """The chapter with this ``key``.

    Raises:
        KeyError: no chapter has that key (the message lists the keys).
    """
    for c in CHAPTERS:
        if c.key == key:
            return c
    raise KeyError(f"no tutorial chapter {key!r}; chapters: {', '.join(c.key for c in CHAPTERS)}")


def grade(chapter: Chapter, choice: int | str) -> bool:
    """True when ``choice`` is the quiz's right answer.

    ``choice``: an index 0..3 or a letter ``"A"``..``"D"`` (any case, surrounding spaces ignored).

    Raises:
        ValueError: anything else (the message says what is accepted).
    """
    return choice_index(choice) == chapter.quiz.answer


def choice_index(choice: int | str) -> int:
    """0..3 from an index or a letter A-D.

    Raises:
        ValueError: not one of 0, 1, 2, 3, "A", "B", "C", "D" (any case).
    """
    if isinstance(choice, bool):
        raise ValueError(f"answer must be 0-3 or A-D, not {choice!r}")
    if isinstance(choice, int):
        if 0 <= choice <= 3:
            return choice
    elif isinstance(choice, str):
        letter = choice.strip().upper()
        if len(letter) == 1 and letter in LETTERS:
            return LETTERS.index(letter)
    raise ValueError(f"answer must be 0-3 or A-D, not {choice!r}")


def model_facts(chapter: Chapter, info: dict[str, Any]) -> list[str]:
    """Lines of real numbers about the loaded model for ``chapter`` (from ``LLMEngine.model_info()``).

    Units: tokens, elements, bytes. Missing keys give fewer lines, never an error.
    """
    key = chapter.key
    g = info.get
    lines: list[str] = []
    try:
        if key == "tokenization" and g("vocab_size"):
            lines.append(f"This model's vocabulary has {g('vocab_size'):,} entries (token ids 0..{g('vocab_size') - 1}).")
        elif key == "embedding" and g("vocab_size") and g("hidden_size"):
            lines.append(f"Its embedding matrix is [{g('vocab_size')}, {g('hidden_size')}]: each token becomes "
                         f"{g('hidden_size')} numbers.")
        elif key == "self_attention" and g("num_heads") and g("num_kv_heads"):
            group = g("num_heads") // g("num_kv_heads")
            lines.append(f"It has {g('num_heads')} query heads sharing {g('num_kv_heads')} KV heads ({group} to 1: "
                         f"query head h reads KV head h // {group}), head_dim {g('head_dim')}, in each of "
                         f"{g('num_layers')} layers.")
        elif key == "prefill" and g("token_budget"):
            chunks = ("a longer prompt is prefilled in chunks" if g("chunked_prefill", True)
                      else "chunked prefill is off, so a longer prompt is refused")
            lines.append(f"This engine's token budget is {g('token_budget')} tokens per step; {chunks}.")
            if g("peak_flops") and g("memory_bandwidth"):
                bw, blocks = g("memory_bandwidth"), tuple(g("block_peaks") or ())
                ridge = f"ridge point {g('peak_flops') / bw:.1f} FLOP/byte"
                if blocks:
                    ridge += " for float operations, " + ", ".join(f"{v / bw:.1f} for {k.upper()} projections"
                                                                    for k, v in blocks)
                each = ", each operation against its kernel's peak" if blocks else ""
                n, machine = int(g("compute_bound_tokens") or 0), str(g("machine") or "")
                if "host was busy" in machine or UNRELIABLE in machine:  # trial 15a: no crossing from an untrusted peak
                    cross = (f"; where a prefill turns compute-bound is not told, as a peak was measured on a busy host "
                             f"(run `{REMEASURE}` when the machine is quiet).")
                elif n > 1:
                    cross = f"; a prefill becomes compute-bound from about {plural(n, 'token')}{each}."
                elif n == 1:
                    cross = f"; even a 1-token step is compute-bound{each}."
                else:
                    cross = "."
                lines.append(f"This machine, measured ({machine}): "
                             f"{peak_words(machine, g('peak_flops'), blocks)}, memory {bw / 1e9:,.1f} GB/s, "
                             + ridge + cross)
        elif key == "kv_cache" and g("kv_bytes_per_token"):
            per = g("kv_bytes_per_token")
            elem = per // (2 * g("num_layers") * g("num_kv_heads") * g("head_dim"))
            kv_dtype = g("kv_dtype") or g("dtype")
            lines.append(f"K/V in {kv_dtype}: 2 x {g('num_layers')} layers x {g('num_kv_heads')} KV "
                         f"heads x {g('head_dim')} x {elem} bytes = {per:,} bytes per token{_ranks(info, per)}; "
                         f"1,000 tokens take {human_bytes(per * 1000)}{_ranks(info, per * 1000, human_bytes)}.")
            if g("quantization") and g("linear_weight_bytes"):
                weights = g("linear_weight_bytes")
                kind = f"{g('weight_kinds') or g('quantization')} block"
                lines.append(f"Its {kind} linear layers and LM head take {human_bytes(weights)}: "
                             f"{weights // per:,} tokens of cache weigh as much.")
            elif g("num_parameters"):
                weights = g("num_parameters") * elem
                lines.append(f"Its {g('num_parameters') / 1e6:.0f} M parameters in {g('dtype')} take "
                             f"{human_bytes(weights)}: {weights // per:,} tokens of cache weigh as much.")
            lines.extend(_decode_growth(info))  # after either branch above
        elif key == "decode" and g("kv_bytes_per_token") and g("num_parameters"):
            lines.extend(_decode_bytes(info))
        elif key == "paged_attention" and g("block_size"):
            per = g("kv_bytes_per_token") or 0
            lines.append(f"This engine's pool: {plural(g('num_kv_blocks'), 'block')} of {g('block_size')} tokens, "
                         f"{per * g('block_size'):,} bytes each{_ranks(info, per * g('block_size'))}; a request leaves at most {g('block_size') - 1} "
                         f"slots empty, {g('block_size') - 1} + k while it speculates with k drafts.")
        elif key == "continuous_batching" and g("max_num_seqs"):
            lines.append(f"This engine runs at most {g('max_num_seqs')} requests at once within "
                         f"{g('token_budget')} tokens per step.")
        elif key == "prefix_caching" and g("block_size"):
            state = "on" if g("prefix_caching") else "off"
            lines.append(f"Prefix caching is {state} in this engine; blocks hold {g('block_size')} tokens.")
        elif key == "tensor_parallel" and g("num_kv_heads"):
            lines.extend(_tensor_parallel_facts(info))
        elif key == "chunked_prefill" and g("scheduling_policy"):
            order = ("higher priority values first (vLLM's priority runs lower values first)"
                     if g("scheduling_policy") == "priority" else "arrival order")
            lines.append(f"This engine schedules by {g('scheduling_policy')}, {order}, with a budget of "
                         f"{g('token_budget')} tokens per step.")
    except (TypeError, ValueError, ZeroDivisionError):
        return lines
    return lines


def _decode_growth(info: dict[str, Any]) -> list[str]:
    """The KV-cache chapter's derived growth: a decode step's constant work against its attention per cached key."""
    from nanovllm_core.educational.xray_costs import LayerDims, decode_growth

    g = info.get
    if not (g("hidden_size") and g("intermediate_size") and g("num_heads") and g("num_kv_heads") and g("head_dim")):
        return []
    d = LayerDims(g("hidden_size"), g("intermediate_size"), g("num_heads"), g("num_kv_heads"), g("head_dim"), 4)
    fixed, per_key, crossover = decode_growth(d)
    return [f"Per layer, a decode step of this model does {fixed:,} FLOPs for its one token whatever the context "
            f"(projections, MLP, norms, RoPE), and {per_key:,} more for each cached key ({g('num_heads')} query "
            f"heads x (2 x {g('head_dim')} for the score + 5 for the softmax + 2 x {g('head_dim')} for the weighted "
            f"value)): attention's share reaches the rest at {crossover:,} tokens of context. The LM head, once per "
            "step, is not in either part."]


def _tensor_parallel_facts(info: dict[str, Any]) -> list[str]:
    """The tensor-parallel chapter's numbers: the sizes that split this model, one rank's shards at the
    smallest such size above 1 (or the engine's own), and a token's all-reduces and their bytes."""
    from nanovllm_core.educational import tp_facts

    try:
        d = tp_facts.dims(info)
    except ValueError:
        return []
    ok = tp_facts.valid_sizes(d.num_heads, d.num_kv_heads, d.intermediate, d.vocab)
    bad = next(n for n in range(2, d.num_kv_heads + 2) if n not in ok)
    cut = ("a KV head" if d.num_kv_heads % bad else "the MLP's features unevenly" if d.intermediate % bad
           else "the vocabulary unevenly")
    lines = [f"Its {d.num_heads} query heads share {d.num_kv_heads} KV heads, the MLP has {d.intermediate:,} "
             f"intermediate features and the vocabulary {d.vocab:,} entries: it splits over {_sizes_words(ok)} "
             f"rank{'s' if ok != [1] else ''}; {bad} would cut {cut}."]
    running = tp_facts.tp_size(info)
    n = running if running > 1 else next((k for k in ok if k > 1), 1)
    if n > 1:
        s = tp_facts.shard_shapes(info, n)[0]
        now = "as this engine runs it" if running > 1 else "if it were split"
        lines.append(f"At N = {n} ({now}) each rank holds {s.q_heads[1] - s.q_heads[0]} query heads and "
                     f"{plural(s.kv_heads[1] - s.kv_heads[0], 'KV head')} of "
                     f"every layer: q [{s.q[0]}, {s.q[1]}], k and v [{s.k[0]}, {s.k[1]}], o [{s.o[0]}, {s.o[1]}], "
                     f"gate and up [{s.gate[0]}, {s.gate[1]}], down [{s.down[0]}, {s.down[1]}] ([in, out]), and "
                     f"{s.embedding[0]:,} of the {d.vocab:,} vocabulary rows.")
        per = info.get("kv_bytes_per_token")
        if isinstance(per, int) and per > 0:
            kvh = s.kv_heads[1] - s.kv_heads[0]
            elem = per // (2 * d.num_layers * d.num_kv_heads * d.head_dim)
            block = info.get("block_size")
            lines.append(f"Each rank's KV cache keeps only its {plural(kvh, 'KV head')}: 2 (K and V) x {d.num_layers} layers x "
                         f"{kvh} x {d.head_dim} x {elem} bytes = {per // n:,} bytes a token on each rank, 1/{n} of the "
                         f"{per:,} the whole model's cache takes"
                         + (f"; a block of {block} tokens holds {per // n * block:,} bytes on each rank." if block else "."))
    elem = tp_facts.dtype_bytes(info)
    count = tp_facts.allreduces_per_step(d.num_layers)
    lines.append(f"A decode token runs 2 x {d.num_layers} + 1 = {count} all-reduces of [1, {d.hidden}] in "
                 f"{_dtype_name(info)} ({d.hidden * elem:,} bytes each, "
                 f"{tp_facts.allreduce_bytes_per_token(d.hidden, elem, d.num_layers):,} bytes a token from each rank), "
                 "one after another: few bytes, many waits.")
    return lines


def _sizes_words(sizes: list[int]) -> str:
    """``[1]`` -> ``"1"``, ``[1, 3]`` -> ``"1 or 3"``, ``[1, 2, 4]`` -> ``"1, 2 or 4"``."""
    words = [str(n) for n in sizes]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _dtype_name(info: dict[str, Any]) -> str:
    """The activations' dtype name from ``model_info()`` (``float32`` when unknown)."""
    return str(info.get("dtype") or "float32")


def weights_kind(info: dict[str, Any]) -> str:
    """How the linear layers and LM head hold their weights, from ``model_info()``: ``"float32"``,
    or ``"q4_1+q8_0 block (0.701 bytes a weight on average, ...)"``."""
    g = info.get
    weights, count = g("linear_weight_bytes"), g("linear_weights")
    mode = g("quantization")
    if mode and count:
        kinds = g("weight_kinds") or mode
        return f"{kinds} block ({weights / count:.3f} bytes a weight on average, the blocks' scales and mins included)"
    return str(g("dtype"))


ELEMENT_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}

POSITION_WORDS = {
    "below": "below it",
    "just below": "just below it (within 2x: near it)",
    "just above": "just above it (within 2x: near it)",
    "above": "above it",
}


def batch_one_against_ridge(info: dict[str, Any], average: float) -> str:
    """Where a batch-1 decode's weight arithmetic sits against the ridge point of the kernel that runs
    it, derived from the figures the sentence shows (trial 14c: the chapter said "far below" beside
    a box whose 2.8 FLOP/byte sat at 0.6x a ridge of 4.6, itself the float matmul's, not the Q4_1
    kernel's that ran).

    Each weight format (``weight_kinds``) at batch 1 does 2 FLOPs over its bytes a weight; its
    ridge point is its kernel's measured peak over the bandwidth: a block kernel's
    (``block_peaks``, timed on this model's weights) or the float matmul's (``peak_flops``).
    ``average``: the step's whole intensity, 2 over the average bytes a weight, used when the
    formats are not known. Returns the rest of the sentence, from ``", "`` to its full stop.
    """
    g = info.get
    bw, peak, machine = g("memory_bandwidth"), g("peak_flops"), g("machine") or ""
    blocks = tuple(g("block_peaks") or ())
    kinds = [k for k in (g("weight_kinds") or "").split("+") if k]
    if not kinds and not g("quantization"):
        kinds = [str(g("dtype") or "float32")]
    parts, positions, unknown = [], [], []
    for k in kinds:
        per = FORMATS[k].bytes_per_weight if is_block(k) else ELEMENT_BYTES.get(k)
        kernel = f"the {k.upper()} block kernel's" if is_block(k) else "the float matmul's"
        p = kernel_peak(k, peak, blocks)
        if per is None:
            continue
        x = 2 / per
        if not p:
            unknown.append(k.upper())
            parts.append(f"{k.upper()} weights: 2 FLOPs for {per:.3f} bytes = {x:.1f} FLOP/byte, not placed against "
                         f"a ridge point: {unknown_peak_reason(machine, [k])}")
            continue
        r = p / bw
        where = ridge_position(x, r)
        positions.append(where)
        parts.append(f"{k.upper()} weights: 2 FLOPs for {per:.3f} bytes = {x:.1f} FLOP/byte, {x / r:.2f}x {kernel} "
                     f"ridge point of {r:.1f} FLOP/byte ({p / 1e9:,.1f} GFLOP/s over {bw / 1e9:,.1f} GB/s): "
                     f"{POSITION_WORDS[where]}")
    busy = " (measured while the host was busy, so the peaks are likely low)" if "host was busy" in machine else ""
    if not parts:  # formats not known (an older engine's info): the whole step against the float ridge
        r = peak / bw
        where = ridge_position(average, r)
        positions.append(where)
        parts.append(f"{average / r:.2f}x this machine's measured ridge point of {r:.1f} FLOP/byte "
                     f"({peak_words(machine, peak, blocks)}, over {bw / 1e9:,.1f} GB/s): {POSITION_WORDS[where]}")
        text = ", " + parts[0]
    else:
        text = ". Against the ridge point of the kernel that multiplies them" + busy + ": " + "; ".join(parts)
        busy = ""
    which = f" ({' and '.join(unknown)} aside)" if unknown and positions else ""
    if not positions:
        return text + busy + "."
    if all(w == "below" for w in positions):
        return text + busy + f": the arithmetic waits on memory{which}, reading the bytes takes longer than the FLOPs."
    if all(w == "above" for w in positions):
        return text + busy + f": on this measurement the FLOPs, not the bytes, take the longer{which}."
    if any(w.startswith("just") for w in positions):
        return text + busy + (": near a ridge point, reading the bytes and doing the FLOPs take about as long, so "
                              "neither alone sets the floor, and a busier host or another kernel can tip it.")
    return text + busy + ": a format below its ridge point waits on memory, one above it on the arithmetic."


def _ranks(info: dict[str, Any], nbytes: float, fmt: Any = None) -> str:
    """" across N ranks (X on each)" under tensor parallelism: ``model_info``'s KV sizes are whole-model totals."""
    from nanovllm_core.educational import tp_facts

    return tp_facts.across_ranks(nbytes, tp_facts.tp_size(info), fmt)


def _decode_bytes(info: dict[str, Any]) -> list[str]:
    """The decode chapter's numbers: the bytes one step reads, why that bounds batch 1, and what else costs time.

    From ``model_info()``: ``linear_weight_bytes`` (every decoder layer's q/k/v, o, gate/up and
    down and the LM head as the loader built them, scales included), ``linear_weights`` (their
    element count), ``quantization`` and ``weight_kinds``, ``kv_bytes_per_token`` and, when
    measured, ``memory_bandwidth`` (bytes/s) and ``peak_flops`` (FLOP/s).
    """
    g = info.get
    per = g("kv_bytes_per_token")
    elem = per // (2 * g("num_layers") * g("num_kv_heads") * g("head_dim"))
    weights, count = g("linear_weight_bytes"), g("linear_weights")
    if not (weights and count):  # an older engine's info: all parameters at the activations' width
        weights, count = g("num_parameters") * elem, None
    row = f" of {g('hidden_size')} numbers" if g("hidden_size") else ""
    from nanovllm_core.educational import tp_facts

    n = tp_facts.tp_size(info)
    # Under tensor parallelism model_info's linear_weight_bytes is rank 0's shard (trial 16c): say so.
    whose = (f"rank 0 of its {n} ranks reads its shard's {human_bytes(weights)} of {weights_kind(info)} weights "
             f"(each rank reads its own shard at the same time)" if n > 1 else
             f"this model reads its {human_bytes(weights)} of {weights_kind(info)} weights")
    lines = [f"A decode step of {whose} once "
             f"for the whole batch: the linear layers of all {g('num_layers')} decoder layers and the LM head (the "
             f"embedding lookup reads one row{row} per token, not the matrix); and for each request its own "
             f"{per:,} bytes of keys and values per token of context{_ranks(info, per)}: "
             f"{human_bytes(per * 1000)} a step at 1,000 tokens, whatever the batch."]
    if count:
        b = weights / count
        why = (f"At batch 1 each of those {count / 1e6:,.0f} M weights serves one multiply-add, 2 FLOPs for its "
               f"{b:.3f} bytes{' on average' if '+' in (g('weight_kinds') or '') else ''}: "
               f"{2 / b:.1f} FLOP per byte read")
        if g("peak_flops") and g("memory_bandwidth"):
            why += batch_one_against_ridge(info, 2 / b)
        else:
            why += "; a machine whose ridge point (peak FLOP/s over bandwidth) is higher waits on memory."
        lines.append(why)
    if g("memory_bandwidth"):
        bw = g("memory_bandwidth")
        busy = " (measured while the host was busy, so likely low)" if "host was busy" in str(g("machine") or "") else ""
        shard = (f" (rank 0's shard; the {n} ranks read theirs at once from the one memory, so its share of the "
                 "bandwidth is less)") if n > 1 else ""
        lines.append(f"At this machine's measured {bw / 1e9:,.1f} GB/s{busy}, reading the weights{shard} alone takes "
                     f"{ms(weights / bw)}: at batch 1 no more than {bw / weights:,.0f} tokens/s, "
                     "however fast the arithmetic.")
    if count and g("quantization"):
        wide = count * 4
        lines.append(f"Block weights are why: the same "
                     f"{count / 1e6:,.0f} M weights in float32 would be {human_bytes(wide)} a step, "
                     f"{wide / weights:.1f}x the bytes.")
    elif count:
        q8 = count * FORMATS["q8_0"].bytes_per_weight
        lines.append(f"With --quantization q8_0 the same {count / 1e6:,.0f} M weights would be about "
                     f"{human_bytes(q8)} (blocks of 32 one-byte weights and their 2-byte scale, 34 bytes; a "
                     f"layer whose width is not a multiple of 32 would stay float): {weights / q8:.1f}x fewer bytes "
                     "per step, so a batch-1 step could be up to that much faster where reading weights is the bound. "
                     "Measured on a 2-core AMD EPYC (Zen 3) it is faster, but by less than that: the weights shrink, "
                     "but the step's other costs do not (norms, RoPE, attention and the Python between them).")
    lines.append("Those bytes set a floor on a step's time, not its time: norms, RoPE, the KV write, attention, "
                 "the Python between operations and each call into a kernel do not shrink with the weights, and the "
                 "fewer the weight bytes, the larger their share of the step. python -m "
                 "benchmarks.benchmark_quantization measures batch-1 decode (128 greedy tokens) on this machine: the "
                 "weight bytes above times a mode's tokens/s, over the bandwidth measured here, is the share of the "
                 "bandwidth that mode reaches.")
    return lines


def _default_path() -> Path:
    from nanovllm_core.paths import cache_root  # torch-free: the Tutorial tab of a replay loads no torch

    return cache_root() / "tutorial_progress.json"


@dataclass
class TutorialProgress:
    """Where a learner is in the tutorial and what they answered, kept between launches.

    ``current``: index into :data:`CHAPTERS`; ``answers``: chapter key -> last chosen index (0..3).
    """

    current: int = 0
    answers: dict[str, int] = field(default_factory=dict)
    notice: str | None = None  # set by load: a malformed file was kept aside (say it to the learner)

    @property
    def score(self) -> int:
        """Number of chapters whose last answer is right."""
        return sum(1 for c in CHAPTERS if self.answers.get(c.key) == c.quiz.answer)

    @property
    def answered(self) -> int:
        """Number of chapters answered (right or wrong)."""
        return sum(1 for c in CHAPTERS if c.key in self.answers)

    def record(self, chapter: Chapter, choice: int | str) -> bool:
        """Keep ``choice`` as this chapter's answer; return whether it is right.

        Raises:
            ValueError: ``choice`` is not 0-3 or A-D.
        """
        index = choice_index(choice)
        self.answers[chapter.key] = index
        return index == chapter.quiz.answer

    @classmethod
    def load(cls, path: Path | None = None) -> "TutorialProgress":
        """Progress saved at ``path`` (default ``<cache_root()>/tutorial_progress.json``).

        A missing or unreadable file gives a fresh progress (never an error); unknown chapter keys
        and out-of-range answers are dropped. A file that is not progress JSON is renamed to
        ``<name>.bad`` (so the next save does not destroy what it held) and ``notice`` says so
        (trial 10: a corrupt file was overwritten without a word).
        """
        path = Path(path) if path is not None else _default_path()
        try:
            data = untrusted.loads(path.read_text(encoding="utf-8"))
        except OSError:
            return cls()
        except ValueError as e:
            return cls._kept_aside(path, f"not JSON ({e})")
        if not isinstance(data, dict):
            return cls._kept_aside(path, f"a JSON {type(data).__name__}, not an object")
        keys = {c.key for c in CHAPTERS}
        raw = data.get("answers")
        answers = {k: v for k, v in raw.items()
                   if k in keys and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 3} \
            if isinstance(raw, dict) else {}
        current = data.get("current")
        if not isinstance(current, int) or isinstance(current, bool) or not 0 <= current < len(CHAPTERS):
            current = 0
        return cls(current=current, answers=answers)

    @classmethod
    def _kept_aside(cls, path: Path, why: str) -> "TutorialProgress":
        """A fresh progress, the malformed file at ``path`` renamed to ``<name>.bad`` and said so."""
        aside = path.with_name(path.name + ".bad")
        try:
            os.replace(path, aside)
            where = f"kept as {aside}"
        except OSError as e:
            where = f"left in place ({e.strerror or e}); the next answer overwrites it"
        return cls(notice=f"the tutorial progress file {path} is {why}; it was {where}, and the tutorial "
                          "starts afresh")

    def save(self, path: Path | None = None) -> None:
        """Write the progress as JSON to ``path`` (default as in :meth:`load`), creating folders.

        The file is replaced atomically, so a crash never leaves half a file.

        Raises:
            OSError: the file cannot be written.
        """
        path = Path(path) if path is not None else _default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"current": self.current, "answers": self.answers}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tutorial_progress.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

"""Speculative decoding inside the paged engine.

A cheap *proposer* guesses the next k tokens of every decoding sequence; the target model
then checks all of them in ONE forward pass over ``1 + k`` tokens (the sequence's newest
token plus the drafts) and keeps the longest prefix it agrees with, plus one token of its
own. Output follows exactly the target's distribution (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling"); the gain is fewer target
forward passes per generated token.

- ``base.py``: what a proposer is (``Proposer``) and what it returns (``Draft``);
- ``proposer.py``: building one from ``speculative_model``
  (loading a draft model when it names one);
- ``ngram.py``: prompt lookup (the tokens that followed the latest earlier match);
- ``draft_model.py``: a draft LLaMA (own KV pool, same block tables) or the target's
  first N layers (self-speculative early exit, writing into the target's own pool);
- ``rejection_sampler.py``: the acceptance rules (argmax equality for greedy requests,
  min(1, p/q) otherwise) and the recovery distribution; the sampler
  (``sampling/sampler.py``) applies them, after the same logits processors as any decode row;
- ``speculator.py``: the engine's side: propose (cut before a banned token), hand each
  sequence's drafts to the sampler, count what was accepted;
- ``metrics.py``: the acceptance counters and E = (1 - alpha^(k+1)) / (1 - alpha);
- ``cli.py``: ``python -m nanovllm_core.speculative.cli``.
"""

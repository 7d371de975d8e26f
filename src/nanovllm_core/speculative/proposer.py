"""Proposers: where draft tokens come from, chosen with ``speculative_model``.

A proposer looks at the step's plan and returns, for every sequence that was given draft
slots (``ScheduledSequence.num_spec_tokens`` > 0), up to that many guessed next tokens and
the distribution each was drawn from. It leaves every sequence's ``token_ids`` as it found
them; the :class:`~nanovllm_core.speculative.speculator.Speculator` appends the drafts.

``speculative_model`` values:

- ``"ngram"``: prompt lookup (:mod:`.ngram`), no model at all;
- ``"self:N"``: the target's first N decoder layers + final norm + LM head (early exit);
- ``"target"``: the target model itself as the draft (every draft is accepted at
  temperature 0; useful to check the machinery, never faster);
- ``"default"``: the embedded default model as the draft;
- anything else: a LLaMA-family model (repo id, folder, ``.gguf``) with the target's vocabulary.
"""

from __future__ import annotations

import torch

from nanovllm_core.engine.model_runner import ModelRunner
from nanovllm_core.model.llama import LlamaForCausalLM
from nanovllm_core.speculative.base import Draft, Proposer  # noqa: F401  (re-exported)
from nanovllm_core.speculative.draft_model import DraftModelProposer
from nanovllm_core.speculative.ngram import NgramProposer


def parse_self_layers(spec: str, num_layers: int) -> int:
    """N of ``"self:N"``, checked against the target's layer count.

    Raises:
        ValueError: N is not in 1..num_layers-1.
    """
    n = int(spec.split(":", 1)[1])
    if not 1 <= n <= num_layers - 1:
        raise ValueError(f"speculative_model={spec!r} is invalid: the target has {num_layers} layers, "
                         f"so N must be between 1 and {num_layers - 1}")
    return n


def needs_draft_model(spec: str | None) -> bool:
    """True when ``speculative_model`` names a model to run (not ``ngram`` or ``self:N``)."""
    return spec is not None and spec != "ngram" and not spec.startswith("self:")


def load_draft_model(spec: str, target: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                     max_model_len: int) -> LlamaForCausalLM:
    """The draft model for ``spec``: the target itself (``"target"``), or loaded with the target's device and dtype.

    Raises:
        ModelLoadError: the draft cannot be found or loaded, or its context is shorter than ``max_model_len``.
        ValueError: its vocabulary differs from the target's (draft tokens would mean other words).
    """
    if spec == "target":
        return target
    from nanovllm_core.model.loader import ModelLoadError, load_model, warm_up

    try:
        draft, _tokenizer, _resolved = load_model(None if spec == "default" else spec, device, dtype,
                                                  max_model_len=max_model_len)
    except ModelLoadError as e:
        raise ModelLoadError(f"draft model {spec!r}: {e}") from None
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model {spec!r} has a vocabulary of {draft.config.vocab_size} tokens but the "
                         f"target has {target.config.vocab_size}; use a draft with the target's tokenizer")
    warm_up(draft)  # its first pass's one-time costs now, as the target's, not in the first verification step
    return draft


def build_proposer(spec: str, target_runner: ModelRunner, draft_model: LlamaForCausalLM | None) -> Proposer:
    """The proposer a ``speculative_model`` setting asks for, drafting for ``target_runner``'s pool.

    ``draft_model``: from :func:`load_draft_model` when :func:`needs_draft_model`, else None.

    Raises:
        ValueError: ``"self:N"`` with N outside 1..num_layers-1.
    """
    if spec == "ngram":
        return NgramProposer()
    if spec.startswith("self:"):
        num_layers = target_runner.model.config.num_hidden_layers
        return DraftModelProposer.early_exit(target_runner, parse_self_layers(spec, num_layers))
    if draft_model is None:
        raise ValueError(f"speculative_model={spec!r} needs a loaded draft model")
    return DraftModelProposer.for_model(draft_model, target_runner, name=spec)

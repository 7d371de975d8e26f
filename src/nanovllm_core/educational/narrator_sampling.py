"""The narrator's words for what the sampler and the speculative verifier did to one sequence.

Every sentence is derived from the events of the step it describes: which distribution a
top-k table shows (the model's own, or the one the sampler chose from after penalties and
temperature, see ``TokenSampled.top`` / ``model_top``), which token greedy decoding took and
why, and which rule a speculative verification applied (``SpecDecodeStep.greedy``; for
traces recorded before that field existed, the request's own temperature decides).

The engine's order of work on a row (``sampling/sampler.py``, vLLM V1's order): the
``min_tokens`` ban, the ``logit_bias`` and the penalties change the raw scores; greedy rows take the argmax
of the result; sampled rows then apply temperature, min-p, top-k and top-p and draw.
"""

from __future__ import annotations

import math
from typing import Any

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import Commentary, agree, join_words, ordinal, plural, show_piece

GREEDY_EPS = 1e-5  # SamplingParams: a temperature below this is greedy


def is_greedy(sampling: dict[str, Any]) -> bool:
    """Whether a request's settings (``RequestAdded.sampling``, non-defaults only) decode greedily."""
    return float(sampling.get("temperature", 1.0)) < GREEDY_EPS


def processors(sampling: dict[str, Any], num_outputs_before: int) -> list[str]:
    """The logits processors that act on a row, in the engine's order, as words.

    ``num_outputs_before``: tokens the sequence had generated before this row (presence and
    frequency penalties count output tokens only, so they do nothing on the first token;
    the ``min_tokens`` ban holds until that many tokens exist).
    """
    out = []
    if num_outputs_before < int(sampling.get("min_tokens", 0)):
        out.append(f"the min_tokens ban on end-of-sequence and stop tokens (until {agree(int(sampling['min_tokens']), '1 is', str(sampling['min_tokens']) + ' are')} generated)")
    if sampling.get("logit_bias"):
        out.append(f"the logit bias on {plural(len(sampling['logit_bias']), 'token')}")
    if float(sampling.get("repetition_penalty", 1.0)) != 1.0:
        out.append(f"repetition penalty {sampling['repetition_penalty']:g}")
    if num_outputs_before and float(sampling.get("frequency_penalty", 0.0)):
        out.append(f"frequency penalty {sampling['frequency_penalty']:g}")
    if num_outputs_before and float(sampling.get("presence_penalty", 0.0)):
        out.append(f"presence penalty {sampling['presence_penalty']:g}")
    return out


def _filters(sampling: dict[str, Any]) -> list[str]:
    out = []
    if float(sampling.get("min_p", 0.0)) > 0:
        out.append(f"min-p {sampling['min_p']:g}")
    if int(sampling.get("top_k", 0)) > 0:
        out.append(f"top-k {sampling['top_k']}")
    if float(sampling.get("top_p", 1.0)) < 1.0:
        out.append(f"top-p {sampling['top_p']:g}")
    return out


# ---------------------------------------------------------------------- the sampling settings


def sampling_intro(name: str, rid: str, s: dict[str, Any], max_tokens: int | None, n: int = 1) -> Commentary:
    """The ``sampling`` entry: what this request's settings will do to every next-token choice, in the engine's order.
    ``n``: the request's samples; with a seed, sample i draws with seed + i (``LLMEngine.add_request``, as vLLM's
    parallel sampling seeds its child requests; trial 36e: "with seed 1" of all three samples)."""
    steps = []
    if int(s.get("min_tokens", 0)):
        steps.append(f"end-of-sequence and stop tokens are banned until {plural(int(s['min_tokens']), 'token')} {agree(int(s['min_tokens']), 'has', 'have')} been generated")
    if s.get("logit_bias"):
        n = len(s["logit_bias"])
        steps.append(f"logit_bias adds its fixed amount (-100 to 100) to the score of {agree(n, 'one token', f'each of {n:,} tokens')}")
    if float(s.get("repetition_penalty", 1.0)) != 1.0:
        r = s["repetition_penalty"]
        steps.append(f"repetition penalty {r:g} {'lowers' if r > 1 else 'raises'} every token already in the prompt "
                     f"or the output (a positive score is divided by {r:g}, a negative one multiplied)")
    if float(s.get("frequency_penalty", 0.0)):
        steps.append(f"frequency penalty {s['frequency_penalty']:g} is subtracted once per time a token was generated")
    if float(s.get("presence_penalty", 0.0)):
        steps.append(f"presence penalty {s['presence_penalty']:g} is subtracted from every token generated at least once")
    stop = _stop_rule(s, max_tokens)
    if is_greedy(s):
        first = ("Greedy decoding (temperature 0): at every step the highest-scoring token is taken"
                 + (", after these changes to the scores: " + "; ".join(steps) if steps else "")
                 + ". Nothing is drawn at random, so the same prompt always gives the same text.")
        return Commentary("sampling", f"Request {rid}: greedy", f"{first} {stop}", request_id=rid)
    t = float(s.get("temperature", 1.0))
    if t == 1:
        steps.append("temperature 1 keeps the scores as they are")
    else:
        steps.append(f"temperature {t:g} divides the scores by {t:g} before the softmax, making the distribution "
                     f"{'sharper' if t < 1 else 'flatter'} than the model's own")
    if float(s.get("min_p", 0.0)) > 0:
        steps.append(f"min-p {s['min_p']:g} drops tokens whose probability is below {s['min_p']:g} x the best one's")
    if int(s.get("top_k", 0)) > 0:
        steps.append(f"top-k {s['top_k']} keeps only the {s['top_k']} most likely tokens")
    if float(s.get("top_p", 1.0)) < 1.0:
        steps.append(f"top-p {s['top_p']:g} keeps the smallest set of most likely tokens whose probabilities add up "
                     f"to at least {s['top_p']:g}")
    text = ("Random sampling, in this order: " + "; ".join(steps) + "; then one token is drawn from what remains, "
            "renormalised" + (("" if s.get("seed") is None else
                               f", with seed {s['seed']} so the draw is repeatable" if n <= 1 else
                               f", sample i with seed {s['seed']} + i ({s['seed']} to {int(s['seed']) + n - 1} for its "
                               f"{n} samples) so each draw is repeatable"))
            + f". {stop}")
    return Commentary("sampling", f"Request {rid}: sampling at temperature {t:g}", text, request_id=rid)


def _stop_rule(s: dict[str, Any], max_tokens: int | None) -> str:
    ends = [] if s.get("ignore_eos") else ["an end-of-sequence token"]
    if s.get("stop"):
        ends.append("a stop string (" + ", ".join(repr(x) for x in s["stop"]) + ")")
    limit = f"after {plural(max_tokens, 'token')}" if max_tokens else "at max_model_len"
    # alternatives: whichever comes first stops it (trial 10: "an end-of-sequence token and a stop string")
    return f"It stops {join_words([f'at {x}' for x in ends] + [limit], 'or')}." if ends else f"It stops {limit}."


# ---------------------------------------------------------------------- one sampled token


def _shows_model_own(e: ev.TokenSampled, procs: list[str]) -> bool:
    """Whether ``e.top`` holds the model's own probabilities (True) or those after processing (False).

    ``model_top`` is filled only when a processor changed the row, and then ``top`` is the
    processed list. Without it, a greedy row or one at temperature 1 shows the model's own
    probabilities either way. A sampled row at another temperature is told apart with the
    chosen token's ``logprob`` (always the model's own): equal probabilities mean ``top`` is
    the model's own too (traces recorded before ``top`` was the processed distribution).
    """
    if e.model_top:
        return False
    if e.greedy or e.temperature == 1:
        return True
    row = next((t for t in e.top if t.token_id == e.token_id), None)
    if row is not None and e.logprob is not None:
        return math.isclose(row.prob, math.exp(e.logprob), rel_tol=1e-3, abs_tol=1e-6)
    return False


def _bytes_piece(e: ev.TokenSampled) -> str:
    """The top-k row's text of a token that is bytes of a character (``<0xE3>``), as the table shows it; "" if not a row."""
    row = next((t for t in e.top if t.token_id == e.token_id), None)
    return show_piece(row.text) + " " if row is not None else ""


def token_label(e: ev.TokenSampled) -> str:
    """The token as a title shows it: its text, the special token's name, or while it is bytes of a
    character that a later token completes, those bytes as its table row shows them and its id."""
    if e.token_text:
        return show_piece(e.token_text)
    if e.special:
        return e.special
    return f"{_bytes_piece(e)}(id {e.token_id}, part of a character)"


def token_words(e: ev.TokenSampled) -> str:
    """The token with its id, as a sentence names it (see :func:`token_label`). A byte token that completes
    a character is named as its table row shows it, then what it completes: ``[<0x93>] (id 237), which
    completes こ`` (trial 15a: "the favourite is [<0x93>] ... takes it: [こ]" named one token two ways)."""
    row = next((t for t in e.top if t.token_id == e.token_id), None)
    if e.token_text and row is not None and row.text.startswith("<0x") and row.text != e.token_text:
        return f"{show_piece(row.text)} (id {e.token_id}), which completes {e.token_text}"
    if e.token_text:
        return f"{show_piece(e.token_text)} (id {e.token_id})"
    if e.special:
        return f"the special token {e.special} (id {e.token_id})"
    piece = _bytes_piece(e)
    named = f"{piece}(id {e.token_id})" if piece else f"id {e.token_id}"
    return f"{named} (bytes of a character that is not complete yet)"


def caption_changes(e: ev.TokenSampled, sampling: dict[str, Any]) -> list[str]:
    """Every processor that changed the distribution ``e.top`` shows, in the engine's order.

    Penalties and the ``min_tokens`` ban on every row; temperature (other than 1), min-p,
    top-k and top-p only on rows that sample (greedy takes the argmax and ignores them). The
    filters leave fewer candidates, renormalised, so a table after them shows larger
    probabilities than after temperature alone.
    """
    procs = processors(sampling, e.num_output_tokens - 1)
    if e.greedy:
        return procs
    return procs + ([f"temperature {e.temperature:g}"] if e.temperature != 1 else []) + _filters(sampling)


def table_caption(e: ev.TokenSampled, sampling: dict[str, Any]) -> str:
    """The caption of ``e.top``'s table: which distribution it is, naming every processor that changed it."""
    changes = caption_changes(e, sampling)
    whose = "the target's" if e.speculative else "the model's"
    if _shows_model_own(e, processors(sampling, e.num_output_tokens - 1)):
        return f"{whose} own probabilities" + (f", before {join_words(changes)}" if changes else "")
    if not changes:
        return "probabilities the sampler used"
    renorm = ", renormalised" if not e.greedy and _filters(sampling) else ""
    return ("the target's " if e.speculative else "") + "probabilities after " + join_words(changes) + renorm


def _all_kept(k: int) -> str:
    """``"The 1 draft was kept"`` / ``"All 3 drafts were kept"``."""
    return agree(k, "The 1 draft was kept", f"All {k} drafts were kept")


def kept_mechanism(e: ev.TokenSampled, v: ev.SpecDecodeStep, i: int, greedy: bool | None) -> str:
    """How the ``i``-th token kept by verification ``v`` was produced: an accepted draft, the
    replacement after a rejection, or the token added after every draft was kept."""
    piece = token_words(e)
    k = len(v.draft_tokens)
    n_ok = next((j for j, ok in enumerate(v.accepted) if not ok), len(v.accepted))
    if i < n_ok:
        how = f"The {v.proposer} proposer drafted {piece} and the verification accepted it"
        if greedy:
            return how + ": it equals the target's highest-scoring token at this position."
        if greedy is False and i < len(v.p):
            chance = min(1.0, v.p[i] / v.q[i]) if v.q[i] else 1.0
            return how + (f", with probability min(1, p/q) = min(1, {v.p[i]:.3f}/{v.q[i]:.3f}) = {chance:.3f}.")
        return how + "."
    if n_ok < k:
        draft = show_piece(v.draft_texts[n_ok]) if n_ok < len(v.draft_texts) else "the draft"
        if greedy:
            return (f"The draft {draft} was not the target's choice here, so greedy verification took the target's "
                    f"highest-scoring token instead: {piece}.")
        if greedy is False:
            point = v.q[n_ok] == 1.0 if n_ok < len(v.q) else False
            rest = ("the target's distribution without the rejected draft, renormalised" if point
                    else "the leftover distribution max(0, p - q), renormalised")
            return f"The draft {draft} was rejected, and {piece} was drawn in its place from {rest}."
        return f"The draft {draft} was not kept; {piece} replaced it."
    if greedy:
        return f"{_all_kept(k)}, and the target added its own highest-scoring next token: {piece}."
    return f"{_all_kept(k)}, and {piece} was drawn from the target's distribution after the last " + agree(k, "draft.", "one.")


def token_choice(e: ev.TokenSampled, sampling: dict[str, Any], vocab: int | None,
                 kept: tuple[ev.SpecDecodeStep, int, bool | None] | None = None) -> tuple[str, str]:
    """What was chosen and from which distribution: (text, caption of the top-k table).

    Greedy decoding is said to take the most likely token only when that token heads the
    table shown; when the table is the model's own and a penalty moved the choice, the text
    says so instead. ``kept``: for a token a speculative verification kept, (the verification,
    the token's place in its kept run, its rule as :func:`verification_rule` gives it); the
    text then names the mechanism (an accepted draft, a replacement, the added token)
    instead of a plain draw.
    """
    piece = token_words(e)
    procs = processors(sampling, e.num_output_tokens - 1)
    caption = table_caption(e, sampling)
    special = (" It is a special token, not text, so the output text leaves it out." if e.special and not e.token_text
               else "")
    if not e.top:
        if kept is not None:
            return kept_mechanism(e, *kept) + special, ""
        how = ("the highest-scoring one" + (f" after {join_words(procs)}" if procs else "") if e.greedy
               else f"drawn at temperature {e.temperature:g}")
        return f"The next token for position {e.position} is {piece}, {how}.{special}", ""
    own = _shows_model_own(e, procs)
    model = "target model" if e.speculative else "model"
    scored = (f"The {model} scored {'all ' + format(vocab, ',') if vocab else 'every'} vocabulary entries for "
              f"position {e.position}")
    best = e.top[0]
    rank = next((i for i, t in enumerate(e.top) if t.token_id == e.token_id), None)
    where = (f"{ordinal(rank + 1)} in the table at {e.top[rank].prob:.2%}" if rank is not None
             else f"outside the table's top {len(e.top)}")
    if kept is not None:
        text = (f"{scored}; in the table the favourite is {show_piece(best.text)} at {best.prob:.2%}. "
                + kept_mechanism(e, *kept) + f" It is {where}.")
    elif e.greedy:
        if rank == 0:
            lead = (f"{scored}; after {join_words(procs)} the highest is {show_piece(best.text)} at {best.prob:.2%}"
                    if not own and procs else f"{scored}; the favourite is {show_piece(best.text)} at {best.prob:.2%}")
            text = f"{lead}. Greedy decoding takes it: {piece}."
        elif not own:  # not expected: greedy takes the first row of the processed table
            text = f"{scored}; greedy decoding took {piece}, {where}."
        else:
            # Only a table of the model's own probabilities can disagree with greedy's choice.
            text = (f"{scored}; the model's own favourite is {show_piece(best.text)} at {best.prob:.2%}, but greedy "
                    f"decoding took {piece}, {where}: {join_words(procs) or 'the logits processors'} "
                    "changed the scores, and greedy takes the highest score after that change.")
    else:
        text = (f"{scored}; in the table the favourite is {show_piece(best.text)} at {best.prob:.2%}. Sampling drew "
                f"{piece}, {where}.")
        filters = _filters(sampling)
        if filters:
            text += f" Before the draw, {join_words(filters)} narrowed the candidates."
    if e.model_top and e.model_top[0].token_id != best.token_id:
        m = e.model_top[0]
        text += (f" Before {join_words(caption_changes(e, sampling)) or 'the processors'}, the model's own favourite was {show_piece(m.text)} "
                 f"at {m.prob:.2%}.")
    return text + special, caption


# ---------------------------------------------------------------------- speculative verification


def verification_rule(e: ev.SpecDecodeStep, sampling: dict[str, Any] | None) -> bool | None:
    """True: greedy verification; False: rejection sampling; None: unknown.

    ``greedy`` is trusted when ``num_query_tokens`` is set (both came with the same engine
    change); older traces leave both at their defaults, so the request's temperature decides.
    """
    if e.num_query_tokens:
        return e.greedy
    return is_greedy(sampling) if sampling is not None else None


def draft_table_caption(greedy: bool | None, sampling: dict[str, Any] | None, outputs_before: int) -> str:
    """The caption of a verification's table of p: the target's probability of each draft, naming
    every processor that made it (the sampler's distribution: penalties; for rejection sampling
    also temperature and the filters, renormalised; trial 11: shown as if the model's own).

    ``outputs_before``: tokens the sequence had generated before the verification (the
    presence and frequency penalties act only after the first).
    """
    title = "the target's probability p of each draft"
    if sampling is None:
        return title
    changes = processors(sampling, outputs_before)
    if greedy is False:
        t = float(sampling.get("temperature", 1.0))
        changes += ([f"temperature {t:g}"] if t != 1 else []) + _filters(sampling)
    if not changes:
        return title + " (its own probabilities)"
    renorm = ", renormalised" if greedy is False and _filters(sampling) else ""
    return f"{title}, after {join_words(changes)}{renorm}"


def speculative_entry(e: ev.SpecDecodeStep, name: str, greedy: bool | None, appended: int | None,
                      sampling: dict[str, Any] | None = None, outputs_before: int = 1, fewer: str = "",
                      kernel: str | None = None) -> Commentary:
    """The ``speculative`` entry of one verification: drafts, tokens run, the rule applied, what was kept.

    ``appended``: tokens the step actually added to the sequence (a stop condition can end it
    inside the kept run); None when unknown. ``sampling`` (the request's non-default settings)
    and ``outputs_before`` name the processors behind p (:func:`draft_table_caption`). ``fewer``:
    why it had fewer drafts than k (:func:`draft_limits_sentence`), told after the drafts. ``kernel``:
    the engine's attention backend (``model_info``); greedy text equals non-speculative decoding's
    token for token on the CPU C kernel (``cpu-paged``) only: another path scores the k + 1 positions
    in other matrix shapes than one-at-a-time decodes, equal up to float rounding (trial 24c).
    """
    k = len(e.draft_tokens)
    n_query = e.num_query_tokens or 1 + k
    n_ok = 0
    for ok in e.accepted:
        if not ok:
            break
        n_ok += 1
    drafts = " ".join(show_piece(t) for t in e.draft_texts)
    text = (f"The {e.proposer} proposer drafted {plural(k, 'token')} {drafts}. The target model ran {plural(n_query, 'token')} "
            f"of this sequence through all its layers in one forward pass (its newest token and the {plural(k, 'draft')}), "
            f"so it scored {k + 1} next-token positions at once.{fewer}")
    bonus = show_piece(e.bonus_text) if e.bonus_token is not None else None
    if greedy:
        text += (" Greedy verification (temperature 0): a draft is kept while it equals the target's highest-scoring "
                 "token at its position, after any penalties.")
        if n_ok < k:
            text += (f" The {ordinal(n_ok + 1)} draft {show_piece(e.draft_texts[n_ok])} is not the target's choice "
                     f"there, so it and any drafts after it are dropped" + (f", and the target's token {bonus} takes its "
                                                                            "place" if bonus else "") + ".")
        elif bonus:
            text += f" {agree(k, 'It', f'All {k}')} matched, and the target's own next token after the last draft, {bonus}, is added."
        if kernel in (None, "", "cpu-paged"):  # (unknown: an old trace; the C kernel was the default then too)
            text += " The text is exactly what greedy decoding without speculation gives."
        else:
            text += (" The text is what greedy decoding without speculation gives, up to float rounding: this "
                     f"attention backend ({kernel}) scores the {k + 1} positions together in other matrix shapes than "
                     "one-at-a-time decodes, which can, rarely, flip a near-tie (the default CPU kernel is exact).")
    elif greedy is False:
        point = all(q == 1.0 for q in e.q)
        text += (" Rejection sampling: each draft x is kept with probability min(1, p(x)/q(x)), target p over draft q"
                 + (f"; an {e.proposer} draft is a fixed guess (q = 1), so it is kept with probability p" if point else "")
                 + ".")
        if n_ok < k:
            i = n_ok
            chance = min(1.0, e.p[i] / e.q[i]) if e.q[i] else 1.0
            text += (f" The {ordinal(i + 1)} draft {show_piece(e.draft_texts[i])} (p = {e.p[i]:.4g}, q = {e.q[i]:.4g}) "
                     f"had a {chance:.4g} chance and was rejected; the drafts after it are dropped")
            if bonus:
                rest = ("the target's distribution without the rejected token" if point
                        else "what is left of the target's distribution, max(0, p - q) renormalised")
                text += f", and {bonus} was drawn in its place from {rest}"
            text += "."
        elif bonus:
            text += f" {agree(k, 'It was', f'All {k} were')} kept, and {bonus} was drawn from the target's distribution after the last draft."
    else:
        text += f" The target kept {n_ok} of {agree(k, 'it', 'them')}" + (f" and added {bonus}" if bonus else "") + "."
    made = n_ok + (1 if e.bonus_token is not None else 0)
    text += f" {plural(made, 'token')} from one forward pass."
    if appended is not None and appended < made:
        text += f" A stop condition ended the sequence after {appended} of {agree(made, 'it', 'them')}."
    notes = tuple("accepted" if ok else ("rejected" if i == n_ok else "dropped")
                  for i, ok in enumerate(e.accepted))
    return Commentary("speculative", f"{name[0].upper()}{name[1:]}: {n_ok}/{k} draft tokens accepted", text,
                      request_id=e.request_id, step=e.step, table=tuple(zip(e.draft_texts, e.p)),
                      table_title=draft_table_caption(greedy, sampling, outputs_before), table_notes=notes)


# ---------------------------------------------------------------------- drafts a step did not get


def _proposer_found(s: ev.ScheduledEntry, proposer: str | None) -> str:
    """What the proposer found for ``s``: its number only when no later cut hides it."""
    n = None if "min_tokens" in s.draft_limits else s.num_drafts
    if proposer == "ngram":
        if n == 0:
            return ("the n-gram proposer found no earlier occurrence of the sequence's last tokens in its prompt and "
                    "text so far, so it proposed nothing")
        return ("the n-gram proposer proposes what followed the latest earlier occurrence of the sequence's last "
                "tokens, and " + (f"only {plural(n, 'token')} followed it" if n is not None else "fewer followed it"))
    name = f"the {proposer} proposer" if proposer else "the proposer"
    return f"{name} proposed " + ("none" if n == 0 else f"only {n}" if n is not None else "fewer")


# The scheduler's reasons for fewer draft slots, as what held the slots down (engine.scheduler.DRAFT_LIMITS).
_SLOT_LIMITS = {
    "budget": "the step's token budget (a token is kept for each running request served after it)",
    "max_tokens": "its max_tokens (a draft gets a slot only if it could be kept)",
    "max_model_len": "the model's length limit, max_model_len",
    "kv_blocks": "the free KV slots (drafts get only the blocks still free once every running request's own tokens "
                 "have theirs, and never take one by preemption)",
}
# The speculator's reasons for fewer drafts than slots.
_DRAFT_LIMITS = {
    "min_tokens": "a drafted token was one the request may not produce yet (min_tokens holds back end-of-sequence "
                  "and stop tokens), so the drafts stop before it",
    "failed_step": "the step's batched forward pass failed and the sequence was run again alone, without drafts",
}


def unfilled_reservations(plan: ev.StepPlanned, s: ev.ScheduledEntry | None = None) -> list[ev.ScheduledEntry]:
    """The speculating entries planned before ``s`` (every one when ``s`` is None) whose draft slots were not all filled.

    The scheduler takes ``1 + num_spec_tokens`` of the budget for such a sequence before the proposer
    runs; a shorter draft leaves the rest of that reservation unspent (nothing else gets it this step).
    Empty for traces recorded before ``plan_order`` existed, where ``s`` is given.
    """
    if s is not None and s.plan_order is None:
        return []
    return [e for e in plan.scheduled if e.num_spec_tokens > e.num_drafts and e is not s
            and (s is None or (e.plan_order is not None and e.plan_order < s.plan_order))]


def budget_at_turn(plan: ev.StepPlanned, s: ev.ScheduledEntry, name, subject: str) -> str:
    """What was left of the budget when ``s``'s turn came, naming draft reservations left unfilled; "" when none.

    ``name(entry)`` names a sequence; ``subject`` names ``s`` (``"request 1"``). E.g. ``"only 1 of them was
    left when request 1's turn came: request 0 had 5, its newest token and 4 draft slots, reserved before the
    proposer ran, and ran only 2 of them (1 draft proposed)"``. Computed from the scheduler's own figures
    (``ScheduledEntry.budget_left``, ``plan_order``); "" when no earlier reservation went unfilled (then the
    tokens the others ran are what they took) or for traces recorded before those fields existed.
    """
    unfilled = unfilled_reservations(plan, s)
    if s.budget_left is None or not unfilled:
        return ""
    before = [e for e in plan.scheduled if e.plan_order is not None and e.plan_order < s.plan_order]
    taken = plan.token_budget - s.budget_left
    left = f"only {s.budget_left} of them {agree(s.budget_left, 'was', 'were')} left when {subject}'s turn came"
    if sum(e.num_own_tokens + e.num_spec_tokens for e in before) != taken:  # slots given back after its turn
        return left
    parts = []
    for e in unfilled:
        newest = "its prompt's last token" if e.kind == "prefill" else "its newest token"
        parts.append(f"{name(e)} had {1 + e.num_spec_tokens}, {newest} and "
                     f"{plural(e.num_spec_tokens, 'draft slot')}, reserved before the proposer ran, and ran only "
                     f"{e.num_tokens} of them ({plural(e.num_drafts, 'draft')} proposed)")
    rest = taken - sum(1 + e.num_spec_tokens for e in unfilled)
    if rest:
        parts.append(f"{plural(rest, 'token')} went to other sequences planned before it")
    return f"{left}: " + "; ".join(parts)


def budget_slots_reason(plan: ev.StepPlanned, s: ev.ScheduledEntry, name) -> str:
    """The budget limit on ``s``'s draft slots told with the step's own figures; "" without them (old traces).

    E.g. ``"the step's token budget of 4: 1 of them went to its prompt's last token, which left 3"``.
    The scheduler gives a speculating sequence the budget left at its turn (``budget_left``) less its
    own token and one token for each running sequence planned after it (``engine.scheduler``); each
    part is named only where this step has it (trial 25c #2: "a token is kept for each running
    request served after it" was told in a step where none was). ``name(entry)`` names a sequence.
    """
    if s.budget_left is None or s.plan_order is None:
        return ""
    left, own = s.budget_left, s.num_own_tokens
    after = [e for e in plan.scheduled if e.plan_order is not None and e.plan_order > s.plan_order
             and e.request_id not in plan.admitted]
    # Exact from the figures unless free KV blocks cut the slots again after the budget sized them.
    kept = min(len(after), left - own) if "kv_blocks" in s.draft_limits else left - own - s.num_spec_tokens
    kept = max(kept, 0)
    parts = []
    if left < plan.token_budget:
        parts.append(budget_at_turn(plan, s, name, name(s))
                     or f"only {left} of them {agree(left, 'was', 'were')} left when its turn came, "
                        f"{plan.token_budget - left} having gone to sequences planned before it")
    newest = "its prompt's last token" if s.kind == "prefill" else "its newest token"
    mine = f"{own} went to {newest}" if own == 1 else f"{own} went to its own tokens"
    if kept:
        who = (f", {join_words([name(e) for e in after])}" if len(after) == kept else "")
        mine += (f" and {kept} {agree(kept, 'was', 'were')} kept for the running "
                 f"{agree(kept, 'request', 'requests')} served after it (a token each{who})")
    room = left - own - kept
    mine += f", which left {room if room else 'none'}"
    return f"the step's token budget of {plan.token_budget}, " + "; ".join(parts + [mine]) if parts else \
        f"the step's token budget of {plan.token_budget}: {mine}"


def draft_limits_sentence(s: ev.ScheduledEntry | None, proposer: str | None = None,
                          plan: ev.StepPlanned | None = None, name=None) -> str:
    """Why ``s`` ran with fewer drafts than k: `` Speculative decoding verifies up to 4 drafts a step; this
    step reserved no draft slot for it, held down by the free KV slots (...).``; "" when none is missing.

    Only for a sequence that could speculate in its step (``max_drafts`` > 0) and got fewer drafts,
    and only with the engine's reasons (``ScheduledEntry.draft_limits``: the scheduler's for the
    slots, ``num_spec_tokens``, then the speculator's for the drafts proposed into them); a trace
    recorded before those fields tells nothing. With ``plan`` and ``name`` (a function naming an entry),
    a budget limit is told with the step's figures (:func:`budget_slots_reason`), naming the draft slots
    reserved before it that the proposer left unfilled (:func:`budget_at_turn`): the step's spent tokens
    alone would leave room (trial 24d #1).
    """
    if s is None or not s.max_drafts or s.num_drafts >= s.max_drafts or not s.draft_limits:
        return ""
    slots = [_SLOT_LIMITS.get(why, why) for why in s.draft_limits if why in _SLOT_LIMITS]
    if "budget" in s.draft_limits and plan is not None and name is not None:
        told = budget_slots_reason(plan, s, name)
        if told:
            slots[[w for w in s.draft_limits if w in _SLOT_LIMITS].index("budget")] = told
    fewer = [_proposer_found(s, proposer) if why == "proposer" else _DRAFT_LIMITS.get(why, why)
             for why in s.draft_limits if why not in _SLOT_LIMITS]
    parts = []
    if slots:
        got = f"slots for {plural(s.num_spec_tokens, 'draft')}" if s.num_spec_tokens else "no draft slot"
        parts.append(f"this step reserved {got} for it, held down by {join_words(slots)}")
    if fewer:
        parts.append(join_words(fewer))
    return f" Speculative decoding verifies up to {plural(s.max_drafts, 'draft')} a step; " + "; ".join(parts) + "."


def draft_limits_tag(s: ev.ScheduledEntry) -> str:
    """The scheduler entry's short form: ``" (no drafts, limited by free KV slots)"``; "" when none is missing."""
    if not s.max_drafts or s.num_drafts >= s.max_drafts or not s.draft_limits:
        return ""
    short = {"budget": "the token budget", "max_tokens": "max_tokens", "max_model_len": "max_model_len",
             "kv_blocks": "free KV slots", "proposer": "what the proposer found", "min_tokens": "min_tokens",
             "failed_step": "a failed batch"}
    by = join_words([short.get(why, why) for why in s.draft_limits])
    got = "no drafts" if not s.num_drafts else f"{s.num_drafts} of up to {s.max_drafts} drafts"
    return f" ({got}, limited by {by})"

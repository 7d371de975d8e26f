"""The narrator's words for the scheduler's decisions: who runs, who waits and why, preemption, prefix hits.

Only what a step's ``StepPlanned`` shows is told: the sequences it scheduled and how many
tokens each, the running ones it could not reach, the waiting queue, the preempted, the
admitted with their prefix-cache hits. The rules quoted are this engine's
(``engine/scheduler.py``, ``engine/block_manager.py``), which follow vLLM's V1 scheduler,
except the priority convention (see :data:`PRIORITY_NOTE`) and a waiting request's preemption of running
ones of lower priority (vLLM V0's rule: in V1 a waiting request that gets no blocks waits), which the
preemption entry says where it happens.
"""

from __future__ import annotations

from typing import Any

# Said wherever a waiting request preempts running ones (trial 13b): this engine's rule is not vLLM V1's.
V0_RULE = ("vLLM V0 did this too; vLLM V1 preempts only for a running request and lets a waiting one wait "
           "until blocks free up")

from nanovllm_core import events as ev
from nanovllm_core.educational.commentary import Commentary, agree, join_words, ordinal, plural
from nanovllm_core.educational.narrator_sampling import draft_limits_tag, unfilled_reservations

PRIORITY_NOTE = ("here a higher priority value is more important; vLLM's is the opposite: lower values run first, "
                 "and its default policy is fcfs")


class SchedulerNarration:
    """Scheduler entries, mixed into ``Narrator``.

    The host provides ``info`` (model_info), ``_name(request_id, index)``, and the
    bookkeeping dicts ``_computed`` / ``_lost`` / ``_request_of`` (seq id -> tokens computed,
    tokens computed when preempted, request id) and ``_last_signature``.
    """

    info: dict[str, Any]
    _computed: dict[int, int]
    _lost: dict[int, int]
    _request_of: dict[int, str]
    _recomputed: dict[int, int]
    _preempts_seen: dict[int, int]
    _last_signature: tuple | None

    @staticmethod
    def _preemptions(plan: ev.StepPlanned, seq_id: int) -> int:
        """How often this sequence has been preempted so far (0 when the plan's queues do not list it)."""
        entry = next((q for q in plan.running if q.seq_id == seq_id), None)
        return entry.num_preemptions if entry is not None else 0

    @staticmethod
    def _idle(plan: ev.StepPlanned) -> list[ev.QueueEntry]:
        """Running sequences that got no token this step (the budget ran out before their turn)."""
        scheduled = {s.seq_id for s in plan.scheduled}
        return [q for q in plan.running if q.seq_id not in scheduled]

    def _order(self) -> str:
        if self.info.get("scheduling_policy", "priority") == "priority":
            return "in priority order, the highest priority value first (vLLM's: the lowest), then by arrival"
        return "in the order they were admitted"

    def _track(self, plan: ev.StepPlanned) -> None:
        """Keep each sequence's computed-token count (a decode computes 1 token, more when drafts are kept)."""
        for q in plan.preempted:
            if q.seq_id in self._computed:  # unknown when the narrator did not see its earlier steps
                self._lost[q.seq_id] = max(self._computed.pop(q.seq_id), self._lost.get(q.seq_id, 0))
                self._preempts_seen[q.seq_id] = self._preempts_seen.get(q.seq_id, 0) + 1
        for s in plan.scheduled:
            self._request_of[s.seq_id] = s.request_id
            if s.kind == "prefill" and s.seq_id in self._lost:
                again = max(0, min(s.start + s.num_own_tokens, self._lost[s.seq_id]) - s.start)
                self._recomputed[s.seq_id] = self._recomputed.get(s.seq_id, 0) + again
            # drafts (after a decode's token or a prompt's last one) count once the verification keeps them
            self._computed[s.seq_id] = s.start + (s.num_own_tokens if s.kind == "prefill" else 1)

    def _forget(self, request_id: str) -> None:
        for seq_id in [q for q, r in self._request_of.items() if r == request_id]:
            for d in (self._computed, self._lost, self._request_of, self._reserved, self._recomputed,
                      self._preempts_seen):
                d.pop(seq_id, None)

    def _planned(self, plan: ev.StepPlanned) -> list[Commentary]:
        out: list[Commentary] = []
        for q in plan.preempted:
            out.append(self._preemption(plan, q))
        for s in plan.scheduled:
            if s.num_cached_tokens > 0 and s.request_id in plan.admitted:
                out.append(self._prefix_hit(plan, s))
        idle = self._idle(plan)
        signature = (tuple((s.request_id, s.index, s.kind) for s in plan.scheduled),
                     tuple(q.request_id for q in plan.waiting), tuple(q.seq_id for q in idle))
        busy = len(plan.scheduled) > 1 or plan.waiting or plan.preempted or idle
        # A step that admits a request the step before left waiting is told, also when it runs alone (trial
        # 22b: the contiguous baseline's next request, admitted when the one before finished, got no entry);
        # a lone request on an idle engine is not (the prefill entry tells it).
        waited = self._last_signature is not None and set(plan.admitted) & set(self._last_signature[1])
        if waited or (busy and (signature != self._last_signature or plan.admitted or plan.preempted)):
            out.insert(0, self._schedule(plan, idle))
        elif plan.waiting or idle:  # the same queue as the step before: one line, every step (trial 14c #4)
            out.insert(0, self._still_waiting(plan, idle))
        self._last_signature = signature
        return out

    def _unfilled_note(self, plan: ev.StepPlanned) -> str:
        """``", counting 3 draft slots of request 0 reserved before the proposer ran and left empty"``: why a budget
        "used up" can exceed the tokens the step ran (trial 24d #1); "" when every reserved slot was filled."""
        unfilled = unfilled_reservations(plan)
        if not unfilled:
            return ""
        empty = sum(e.num_spec_tokens - e.num_drafts for e in unfilled)
        whose = join_words([self._name(e.request_id, e.index) for e in unfilled])
        return f", counting {plural(empty, 'draft slot')} of {whose} reserved before the proposer ran and left empty"

    def _still_waiting(self, plan: ev.StepPlanned, idle: list[ev.QueueEntry]) -> Commentary:
        """A step whose waiting queue and idle running sequences are those of the step before, in one line:
        ``Request 1 keeps waiting (the step's token budget of 8 is used up).``"""
        said = []
        if plan.waiting:
            head = plan.waiting[0]
            name = self._name(head.request_id, head.index)
            text = f"{name[0].upper()}{name[1:]} keeps waiting ({self._waiting_reason(plan)})"
            behind = [self._name(q.request_id, q.index) for q in plan.waiting[1:6]]
            if len(plan.waiting) > 6:
                behind.append(f"{len(plan.waiting) - 6} more")
            if behind:
                text += f", and {join_words(behind)} behind it"
            said.append(text + ".")
            title = f"Step {plan.step}: {name} keeps waiting"
        if idle:
            names = join_words([self._name(q.request_id, q.index) for q in idle])
            one = len(idle) == 1
            said.append(f"{names[0].upper()}{names[1:]} {'is' if one else 'are'} running but again got no token (the "
                        f"budget was used up before {'its' if one else 'their'} turn{self._unfilled_note(plan)}).")
            if not plan.waiting:
                title = f"Step {plan.step}: {names} again got no token"
        return Commentary("scheduler", title, " ".join(said), step=plan.step)

    def _schedule(self, plan: ev.StepPlanned, idle: list[ev.QueueEntry]) -> Commentary:
        parts = []
        for s in plan.scheduled:
            name = self._name(s.request_id, s.index)
            if s.kind == "decode":
                # a readmission whose every token but the newest was found in the prefix cache runs as a decode:
                # it is still a readmission (trial 41e: "decode, 1 token" beside the entry telling the 16 reused)
                back = (f", readmitted after preemption ({plural(s.num_cached_tokens, 'token')} from the prefix cache)"
                        if s.request_id in plan.admitted and self._preemptions(plan, s.seq_id) else "")
                parts.append((f"{name}: decode, 1 token" if s.num_tokens == 1 else
                              f"{name}: decode with {plural(s.num_tokens - 1, 'draft token')}, {s.num_tokens} tokens")
                             + back + draft_limits_tag(s))
                continue
            n, total = s.num_own_tokens, s.seq_len  # without the drafts a prompt's last token may carry
            end = s.start + n - 1
            if self._preemptions(plan, s.seq_id):
                # Of these, the part it had computed before its preemption is recomputed; the rest (its newest
                # sampled token at least) never had keys and values (trial 21a bug 2: all were called recomputed).
                again, first = self._split(s.seq_id, s.start, s.start + n)
                span = f"({s.start}..{end} of {total})"
                if again is None or not first:
                    what = f"recompute of {plural(n, 'token')} {span}"
                elif not again:
                    what = f"{plural(n, 'new token')} {span}, none computed before its preemption"
                else:
                    what = f"{plural(n, 'token')} {span}: {again} recomputed, {first} new"
                if s.request_id in plan.admitted:
                    what += ", readmitted after preemption"
            elif s.start > s.num_cached_tokens or end + 1 < total:
                span = f"{s.start}..{end}" if n > 1 else f"token {s.start}"
                what = f"prefill chunk of {plural(n, 'token')} ({span} of {s.prompt_len})"
            else:
                what = f"prefill of {plural(n, 'token')}"
            if s.num_drafts:
                what += f" and {plural(s.num_drafts, 'draft token')} after it, {s.num_tokens} tokens"
            what += draft_limits_tag(s)
            if s.request_id in plan.admitted and s.start == s.num_cached_tokens and not self._preemptions(plan, s.seq_id):
                what += ", newly admitted"
            parts.append(f"{name}: {what}")
        budget = (f"its {plan.token_budget}-token budget (max_model_len: the contiguous baseline runs a whole prompt "
                  "in one step)" if self.info.get("paged") is False else f"its {plan.token_budget}-token budget")
        unfilled = unfilled_reservations(plan)
        reserved = ""
        if unfilled:  # slots the scheduler took from the budget before the proposer ran, left empty (trial 24d #1)
            empty = sum(e.num_spec_tokens - e.num_drafts for e in unfilled)
            whose = join_words([self._name(e.request_id, e.index) for e in unfilled])
            reserved = (f" (it had planned {plan.num_batched_tokens + empty}: {plural(empty, 'draft slot')} of "
                        f"{whose}, reserved before the proposer ran, stayed empty and went to no one)")
        text = (f"The scheduler spends {plan.num_batched_tokens} of {budget}{reserved} on "
                f"{plural(len(plan.scheduled), 'sequence')} in one forward pass: " + "; ".join(parts) + ".")
        if idle:
            names = join_words([self._name(q.request_id, q.index) for q in idle])
            text += (f" {names[0].upper()}{names[1:]} {'is' if len(idle) == 1 else 'are'} running but got no token: the "
                     f"budget was used up before {'its' if len(idle) == 1 else 'their'} turn"
                     f"{self._unfilled_note(plan)} (running requests are served {self._order()}).")
        if plan.waiting:
            head = plan.waiting[0]
            text += f" Waiting: {self._name(head.request_id, head.index)} ({self._waiting_reason(plan)})"
            if len(plan.waiting) > 1:
                rest = ", ".join(self._name(q.request_id, q.index) for q in plan.waiting[1:6])
                text += f"; behind it, in {self.info.get('scheduling_policy', 'policy')} order: {rest}"
                if len(plan.waiting) > 6:
                    text += f" and {len(plan.waiting) - 6} more"
            text += "."
        return Commentary("scheduler", f"Step {plan.step}: {len(plan.running)} running, {len(plan.waiting)} waiting",
                          text, step=plan.step)

    def _waiting_reason(self, plan: ev.StepPlanned) -> str:
        """Why the head of the waiting queue waits: the engine's ``StepPlanned.wait_reason``, or for a trace
        recorded before it, what the plan's figures show."""
        why = plan.wait_reason
        head = plan.waiting[0]
        # The budget the plan took: own tokens and every draft slot reserved, filled or not (a proposer
        # that drafted fewer leaves num_batched_tokens below what the scheduler counted).
        left = plan.token_budget - sum(s.num_own_tokens + s.num_spec_tokens for s in plan.scheduled)
        if not why:  # a trace recorded before the engine said why
            why = ("preempted" if plan.preempted else "max_num_seqs" if len(plan.running) >= plan.max_num_seqs
                   else "budget" if left <= 0
                   else "chunked_prefill_off" if (self.info.get("chunked_prefill") is False
                                                  and head.num_tokens - head.num_computed_tokens > left)
                   else "kv_blocks")
        if why == "preempted":
            return ("a step that preempts admits no one after that" if plan.admitted
                    else "this step had to preempt, so no new request is admitted")
        if why == "max_num_seqs":
            if self.info.get("paged") is False:
                return "the contiguous baseline runs one request at a time, and one is running"
            return (f"max_num_seqs: {plural(plan.max_num_seqs, 'sequence')} {agree(plan.max_num_seqs, 'is', 'are')} "
                    "already running (a request with n samples runs n)")
        if why == "budget":
            return f"the step's token budget of {plan.token_budget} is used up{self._unfilled_note(plan)}"
        if why == "chunked_prefill_off":
            return (f"its {plural(head.num_tokens, 'token')} {agree(head.num_tokens, 'does', 'do')} not fit the "
                    f"{left} left of the budget, and chunked prefill is off")
        if why == "kv_run" and len(plan.wait_blocks) == 3:
            free, run, longest = plan.wait_blocks
            return (f"{plural(free, 'KV block')} {agree(free, 'is', 'are')} free in all but no run of {run} adjacent "
                    f"ones (the longest is {longest}): the contiguous baseline reserves its whole length as one region, "
                    f"so a free pool cut into pieces still makes it wait. This is external fragmentation, which "
                    f"paging avoids with block tables (Kwon et al. 2023, section 3)")
        return "not enough free KV blocks for it now"

    def _preemption(self, plan: ev.StepPlanned, q: ev.QueueEntry) -> Commentary:
        policy = self.info.get("scheduling_policy", "priority")
        name = self._name(q.request_id, q.index)
        rule = self._victim_rule(plan, q, policy)
        short = self._shortfall(plan, q)
        if short is not None:
            needer = self._name(short.request_id, short.index)
            need = f"{plural(short.blocks_needed, 'more KV block')}"
            free = ("none was free" if short.blocks_free == 0
                    else f"only {short.blocks_free} {agree(short.blocks_free, 'was', 'were')} free")
            if short.waiting:
                prio = self._priority_of(plan, short.seq_id)
                why = (f"{needer}{f' (priority {prio})' if prio is not None else ''} was waiting and needed {need} "
                       f"to be admitted, and {free}. Under the priority policy a waiting request may take the blocks "
                       f"of running requests of lower priority, lowest first and the latest to arrive among equals, "
                       f"so {name} (priority {q.priority}) was preempted ({V0_RULE})")
            elif short.seq_id == q.seq_id:
                why = (f"{name} needed {need} for this step and {free}, so the scheduler preempted {name} itself "
                       f"(priority {q.priority}): it was {rule}")
            else:
                why = (f"{needer} needed {need} for this step and {free}, so the scheduler preempted {name} "
                       f"(priority {q.priority}): it was {rule}")
        elif policy == "priority" and (admitted := [s for s in plan.scheduled
                                                    if s.request_id in plan.admitted and s.priority > q.priority]):
            # A recording made before the plan carried its shortfalls: the admitted request is the likely cause.
            winner = max(admitted, key=lambda s: s.priority)
            why = (f"{self._name(winner.request_id, winner.index)} (priority {winner.priority}) was waiting and too "
                   f"few KV blocks were free for it. Under the priority policy a waiting request may take the blocks "
                   f"of running requests of lower priority, lowest first and the latest to arrive among equals, so "
                   f"{name} (priority {q.priority}) was preempted ({V0_RULE})")
        else:
            why = (f"A running request needed more KV blocks for this step than were free, so the scheduler "
                   f"preempted {name} (priority {q.priority}): it was {rule}, which can be the very request that "
                   "needed them")
        kept, never = self._kept_tokens(q)
        if self.info.get("prefix_caching") is False:
            back = ("when readmitted, all of them run through the model again (prefix caching is off): those it "
                    f"had computed are recomputed, the rest{never} computed for the first time")
        else:
            back = ("its full blocks keep their contents as cached-free blocks until the pool needs their space (a "
                    "full block whose contents another block already holds is simply freed); when it is readmitted, "
                    "the blocks still in the prefix cache are reused and only the rest is computed: recomputed where "
                    f"it had computed them, for the first time where not{never}")
        why = why[0].upper() + why[1:]  # "request 3 (priority 10) was waiting..." begins the entry (trial 11)
        text = (f"{why}. It gave back all its blocks and went back to the waiting queue keeping its "
                f"{kept}: {back}. " + self._again_and_again(q))
        if policy == "priority":
            text += f" ({PRIORITY_NOTE[0].upper()}{PRIORITY_NOTE[1:]}.)"
        return Commentary("preemption", f"Step {plan.step}: {name} preempted", text,
                          request_id=q.request_id, step=plan.step)

    @staticmethod
    def _victim_rule(plan: ev.StepPlanned, q: ev.QueueEntry, policy: str) -> str:
        """What made ``q`` the victim in this step, said of this step's running requests (those still running
        after the plan): the policy's rule names only the part that decided (trial 38e: "the latest to arrive
        among equals" for a victim that had no equal and had arrived first)."""
        others = [e for e in plan.running if e.seq_id != q.seq_id]
        if not others:
            return "the only running request"
        if policy != "priority":
            return "the running request that arrived last"
        equals = {e.request_id for e in others if e.priority == q.priority} - {q.request_id}
        if not equals:  # alone at its priority, or beside its own samples only (n > 1: the last one queued)
            own = any(e.request_id == q.request_id for e in others)
            return "the lowest-priority running request" + (", and the last of its samples queued" if own else "")
        return (f"the lowest-priority running request, and of the {len(equals) + 1} requests at priority "
                f"{q.priority} the latest to arrive")

    def _kept_tokens(self, q: ev.QueueEntry) -> tuple[str, str]:
        """What preempted ``q`` keeps, and which of its tokens were never computed (to be computed for the
        first time), as the preemption entry words them: ``("83 prompt tokens, 56 of them computed",
        " (prompt tokens 56..82, which its prefill had not reached)")``. A request preempted while decoding
        keeps prompt and generated tokens, its newest one sampled but never run through the model; one
        preempted in the middle of its prefill has generated nothing, and what it never computed is the
        rest of its prompt (trial 29e: "its 83 tokens (prompt and generated) ... its newest token at
        least" for a request that had prefilled 56 of 83 prompt tokens)."""
        request = getattr(self, "_requests", {}).get(q.request_id)
        total = q.num_tokens
        if request is None:  # the narrator did not see it added (attached mid-run): no split known
            return f"{plural(total, 'token')} (prompt and any generated)", ""
        prompt = request.num_prompt_tokens
        made = total - prompt
        if made > 0:
            return (f"{plural(total, 'token')} ({prompt} prompt + {made} generated)",
                    " (its newest token at least, sampled but not yet run through the model)")
        computed = self._computed.get(q.seq_id)
        if computed is None or computed >= total:
            return f"{plural(total, 'prompt token')}, none generated yet", ""
        span = f"prompt token {computed}" if total - computed == 1 else f"prompt tokens {computed}..{total - 1}"
        return (f"{plural(total, 'prompt token')}, {computed} of them computed, none generated yet",
                f" ({span}, which its prefill had not reached)")

    def _again_and_again(self, q: ev.QueueEntry) -> str:
        """How often ``q`` has been preempted, and from the second time what the repeats cost (trial 12)."""
        n = q.num_preemptions
        request = getattr(self, "_requests", {}).get(q.request_id)
        counted = "sample" if (request is not None and request.n > 1) or q.index > 0 else "request"
        if n < 2:  # a sample's own count (trial 30e: "of this request" after its sibling's "2nd preemption")
            return f"Preemptions of this {counted} so far: {n}."
        text = f"This is its {ordinal(n)} preemption"
        if self._preempts_seen.get(q.seq_id) == n - 1:  # the narrator saw every earlier one
            redone = self._recomputed.get(q.seq_id, 0)
            text += (f": after the earlier {plural(n - 1, 'preemption')} it recomputed {plural(redone, 'token')} "
                     "whose keys and values it had already computed once (tokens the prefix cache gave back are not "
                     "counted), work this preemption may have to repeat")
        return (text + ". When the pool is this tight a request can be readmitted and preempted again and again, "
                "recomputing each time what it lost; vLLM also preempts by recompute, so a pool this small makes it "
                "repeat the same way. More KV blocks, or fewer requests running at once (max_num_seqs), avoid it.")

    @staticmethod
    def _shortfall(plan: ev.StepPlanned, q: ev.QueueEntry) -> ev.Shortfall | None:
        """Why ``q`` was preempted, from the plan (None in recordings made before plans carried it)."""
        shortfalls = getattr(plan, "shortfalls", ())
        if len(shortfalls) != len(plan.preempted):
            return None
        return next((w for p, w in zip(plan.preempted, shortfalls) if p.seq_id == q.seq_id), None)

    @staticmethod
    def _priority_of(plan: ev.StepPlanned, seq_id: int) -> int | None:
        for entry in (*plan.scheduled, *plan.waiting, *plan.running):
            if entry.seq_id == seq_id:
                return entry.priority
        return None

    def _prefix_hit(self, plan: ev.StepPlanned, s: ev.ScheduledEntry) -> Commentary:
        bs = self.info.get("block_size")
        blocks = f" ({plural(s.num_cached_tokens // bs, 'full block')})" if bs else ""
        name = self._name(s.request_id, s.index)
        c, total = s.num_cached_tokens, s.total_len
        now = "" if c + s.num_tokens == total else f", {s.num_tokens} of them in this step"
        # The hit stops before the block of the last token even when that full block is cached too (trial 10).
        last = (f"; the block holding the last token (tokens {c}..{total - 1}) is never a hit, even when the cache "
                "holds it: sampling needs that token's scores, so it is computed here"
                if bs and total % bs == 0 and c == (total - 1) // bs * bs else "")
        if self._preemptions(plan, s.seq_id):
            again, first = self._split(s.seq_id, c, total)
            # Both splits, each beside its own count: "32 of its 33 tokens (20 prompt + 13 generated) are found"
            # read as 20 + 13 found (trial 29d). The cache holds a prefix, so the prompt's tokens come first.
            found_prompt = min(c, s.prompt_len)
            found = (f"{found_prompt} prompt + {c - found_prompt} generated" if c > found_prompt
                     else agree(c, 'a prompt token', 'all of them prompt tokens'))
            text = (f"{name[0].upper()}{name[1:]} is readmitted after its preemption: of its {total} tokens "
                    f"({s.prompt_len} prompt + {total - s.prompt_len} generated), {c} ({found}) {agree(c, 'is', 'are')} found in the prefix "
                    f"cache{blocks}{self._hit_source(s, bs, self._has_samples(s.request_id))}. Their keys and "
                    f"values are reused; only the other {total - c} {agree(total - c, 'is', 'are')} computed{now}{self._again(again, first)}"
                    f"{last}.")
            title = (f"{name}: readmitted, {plural(c, 'token')} reused, {again} recomputed" if again is not None
                     else f"{name}: readmitted, {plural(c, 'token')} reused, {total - c} computed")
        elif s.index > 0:
            text = (f"Sample {s.index} shares the first {c} of the {s.prompt_len} prompt tokens with sample 0 "
                    f"through the prefix cache{blocks}, whose reference counts go up. It computes the other "
                    f"{total - c} itself{now}: only full blocks are cached, and a hit never includes the block that "
                    "holds the prompt's last token, whose scores each sample needs.")
            title = f"{name}: shares {c} prompt tokens with sample 0"
        else:
            text = (f"{name[0].upper()}{name[1:]} found its first {c} of {plural(total, 'token')} already in the prefix "
                    f"cache{blocks}. {agree(c, 'Its', 'Their')} keys and values are reused, not computed; only the other "
                    f"{total - c} {agree(total - c, 'is', 'are')} computed{now}{last}.")
            title = f"{name}: prefix cache hit, {plural(c, 'token')}"
        return Commentary("prefix_cache", f"{title[0].upper()}{title[1:]}", text, request_id=s.request_id,
                          step=plan.step)

    def _has_samples(self, request_id: str) -> bool:
        """The request runs n > 1 samples: a block another sequence holds may be a sibling sample's."""
        state = self._requests.get(request_id)
        return state is not None and state.n > 1

    @staticmethod
    def _hit_source(s: ev.ScheduledEntry, bs: int | None, samples: bool = False) -> str:
        """Where a readmission's hit blocks were, from the engine's count of those another sequence
        held (``ScheduledEntry.num_cached_blocks_in_use``) and of the cached-free ones that were its own
        before its preemption (``num_cached_blocks_own``; the others another request left cached-free:
        trial 17b #2); empty when unknown (an older trace). ``samples``: the request runs n > 1 samples,
        so a holder may be one of them, not another request (trial 34e: a sibling sample was "another
        running request"); the engine's count does not say which."""
        shared = s.num_cached_blocks_in_use
        if shared is None or not bs:
            return ""
        hit = s.num_cached_tokens // bs
        free = hit - shared
        if shared <= 0:
            return ", " + SchedulerNarration._free_hits(free, getattr(s, "num_cached_blocks_own", None))
        one, many = (("another running sequence (another sample of this request, or another request)",
                      "running sequences (other samples of this request, or other requests)") if samples else
                     ("another running request", "running requests"))
        held = (f"the block that {one} holds for the same tokens, shared with it (its reference count goes up)"
                if shared == 1 else
                f"{shared} blocks that {many} hold for the same tokens, shared with them (their reference "
                "counts go up)")
        if free <= 0:
            return f": {held}, not {'a block' if shared == 1 else 'blocks'} that had been cached-free"
        return f": {held}, and " + SchedulerNarration._free_hits(free, getattr(s, "num_cached_blocks_own", None))

    @staticmethod
    def _free_hits(free: int, own: int | None) -> str:
        """``free`` cached-free hit blocks of a readmission, ``own`` of them its own from before its
        preemption (None: not known, an older trace): whose they were."""
        if own is None:
            return ("blocks that kept their contents while they were cached-free" if free > 1 else
                    "a block that kept its contents while it was cached-free")
        own = max(0, min(own, free))
        others = free - own
        mine = (f"its own {'block' if own == 1 else f'{own} blocks'} from before the preemption, kept cached-free "
                "with {} contents".format("its" if own == 1 else "their")) if own else ""
        theirs = (f"{'a block' if others == 1 else f'{others} blocks'} that another request left cached-free "
                  "with the same tokens") if others else ""
        return " and ".join(p for p in (mine, theirs) if p)

    @staticmethod
    def _again(again: int | None, first: int) -> str:
        """``": 2 recomputed, ..., and 1 computed for the first time"`` (empty when unknown)."""
        if again is None:
            return ""
        if not again:
            return ", none of them computed before its preemption"
        return (f": {again} recomputed, {'its' if again == 1 else 'their'} keys and values lost with its blocks"
                + (f", and {first} computed for the first time" if first else ""))

    def _split(self, seq_id: int, start: int, end: int) -> tuple[int | None, int]:
        """Of tokens ``start..end-1``: (how many it had computed before its preemption, how many are new).

        (None, 0) when the narrator did not see the sequence's earlier steps.
        """
        lost = self._lost.get(seq_id)
        if lost is None:
            return None, 0
        again = max(0, min(end, lost) - start)
        return again, end - start - again

    def _beside(self, plan: ev.StepPlanned, s: ev.ScheduledEntry) -> str:
        """What else ran, or could not run, in the step of a prefill chunk: only what the plan shows."""
        others = [x for x in plan.scheduled if x.seq_id != s.seq_id]
        decoding = [x for x in others if x.kind == "decode"]
        prefilling = [x for x in others if x.kind == "prefill"]
        idle = self._idle(plan)
        text = ""
        if decoding:
            names = join_words([self._name(x.request_id, x.index) for x in decoding])
            text += (f" In the same step {names} decoded ({plural(sum(x.num_tokens for x in decoding), 'token')}): "
                     f"the chunk did not stop {'it' if len(decoding) == 1 else 'them'}.")
        if prefilling:
            names = join_words([self._name(x.request_id, x.index) for x in prefilling])
            text += f" {names[0].upper()}{names[1:]} prefilled in the same step."
        if idle:
            names = join_words([self._name(q.request_id, q.index) for q in idle])
            text += (f" {names[0].upper()}{names[1:]} {'is' if len(idle) == 1 else 'are'} running but got no token in "
                     f"this step: running requests are served {self._order()}, and the budget was used up before "
                     f"{'its' if len(idle) == 1 else 'their'} turn.")
        if not others and not idle:
            text += " No other request was running."
        return text

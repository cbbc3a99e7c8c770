"""The scheduler: which sequences compute how many tokens this step. Plain Python (no torch)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from bulkgen.engine.block_manager import PARTIAL_MIN_TOKENS, BlockManager, CachedPrefix
from bulkgen.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens (its draft's included)
    num_draft_tokens: int = 0  # the last of them: seq.draft, to be verified (speculate.py)

    @property
    def num_sampled(self) -> int:
        """Rows of this sequence the step samples: each draft token's and the one after them where the sequence
        reaches its known tokens (0 for a prefill chunk short of them)."""
        if self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens < self.seq.num_tokens:
            return 0
        return 1 + self.num_draft_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # running sequences first (admission order), then newly admitted ones
    preempted: list[Sequence] = field(default_factory=list)  # sent back to the waiting queue this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class AdmissionPolicy(Protocol):
    """Decides whether a waiting sequence may start now, beyond there being blocks for it (the packer's
    projection of future KV use, say). Without one, admission is strict order while blocks last."""

    lookahead: int  # how far down the waiting queue to look for a sequence that fits (backfilling)

    def can_admit(self, candidate: Sequence, running: list[Sequence]) -> bool: ...

    def earliest_start(self, blocked: Sequence, running: list[Sequence]) -> int:
        """Steps until `blocked` could be admitted, as the running sequences finish."""
        ...

    def remaining_steps(self, seq: Sequence) -> int: ...

    def prioritize(self, waiting: deque[Sequence], running: list[Sequence]) -> None:
        """Reorder the waiting queue in place (or leave it); called before admission after a finish."""
        ...

    def observe_finished(self, num_output_tokens: int, max_new_tokens: int, ignore_eos: bool) -> None: ...


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 admission: AdmissionPolicy | None = None) -> None:
        self.block_manager = block_manager
        self.admission = admission
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self._finished_since_admission = False

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """
        The rule (after vLLM's v1 scheduler): there is no prefill phase and no decode phase. A step
        has a token budget. Each running sequence, then each waiting one, is given as many tokens as
        it needs for its computed tokens to catch up with its known tokens (prompt + output so far),
        as far as the budget and the free KV blocks allow. So a decode takes 1 token; a new prompt
        takes all of its tokens, over several steps if the budget is short (chunked prefill); a
        preempted sequence takes all of its tokens again (recompute), less any prefix still cached.
        When a running sequence cannot get its blocks, the most recently admitted running sequence
        is preempted (blocks freed, sent to the front of the waiting queue), never a crash; a step
        that had to preempt admits nobody new.
        """
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens + len(seq.draft), budget)
            assert num_new > 0, "a running sequence always has a token to compute"
            if seq.draft and not bm.can_allocate(seq, num_new):
                num_new = min(seq.num_uncomputed_tokens, budget)  # a draft is the first thing given up
            num_draft = max(0, num_new - seq.num_uncomputed_tokens)
            del seq.draft[num_draft:]
            while not bm.can_allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                out.scheduled.append(ScheduledSeq(seq, num_new, num_draft))
                budget -= num_new
                i += 1
        if out.preempted:
            return out
        # Strict order by default (vLLM's): admission stops at the first sequence that does not fit.
        # An admission policy may backfill: look further down the queue for sequences that fit now
        # and will have finished by the time the first one can start, so they never delay it.
        lookahead = self.admission.lookahead if self.admission is not None else 1
        if self._finished_since_admission and self.admission is not None:
            self.admission.prioritize(self.waiting, self.running)
        self._finished_since_admission = False
        i = 0
        horizon: int | None = None  # steps until the blocked head of the queue can start
        # A prompt block that a running sequence is still computing: a sequence whose next block it is waits for it
        # to enter the prefix cache (a step or two of prefill) rather than compute it a second time beside it; so does
        # one that would copy the start of a block a running one is computing (bm.part_key: a document's last tokens,
        # then each question's), or the last tokens of the same prompt (bm.tail_key: a prompt's samples).
        in_flight = {h for s in self.running for h in self._in_flight(s)} if self.waiting else set()
        # and the tokens of each prompt block a running prefill is computing, by part_key: a prompt whose partial copy
        # would be shorter than what such a block will hold waits for it too (questions that begin alike)
        parts: dict[tuple, list] = {}
        if self.waiting:
            for s in self.running:
                self._parts_in_flight(s, parts)
        holders: dict[int, int] | None = None  # block -> the most steps left of a running sequence holding it
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            # A backfill must end before the blocked head can start: that cheap test first.
            fits = horizon is None or self.admission.remaining_steps(seq) < horizon
            shared = False
            if fits:
                cached = bm.find_cached_prefix(seq)
                hashes = bm.prompt_hashes(seq) if in_flight else ()
                # (the last token is always computed, so a block holding it is never taken from the cache)
                full = (seq.num_tokens - 1) // bm.block_size
                shared = len(cached) < min(len(hashes), full) and hashes[len(cached)] in in_flight
                if in_flight and not shared and seq.num_output_tokens == 0:  # and a block it could copy part of
                    key = bm.part_key(seq, len(cached))
                    shared = (not cached.partial and key in in_flight) or (
                        len(cached) == full and cached.num_tokens(bm.block_size) < seq.num_tokens - 1
                        and bm.tail_key(seq) in in_flight) or (
                        bool(cached.partial) and key in parts and self._longer_in_flight(seq, cached, parts[key]))
                num_new = min(seq.num_tokens - cached.num_tokens(bm.block_size), budget)
                if cached and self.admission is not None and not bm.layout.slides:
                    holders = self._holders() if holders is None else holders
                    seq.num_shared_tokens = self._shared_tokens(seq, cached, holders)
                fits = not shared and bm.can_allocate(seq, num_new, cached) and (
                    self.admission is None or self.admission.can_admit(seq, self.running))
            if not fits:
                if i + 1 >= lookahead:
                    break
                if horizon is None and not shared:
                    horizon = self.admission.earliest_start(seq, self.running)
                i += 1
                continue
            del self.waiting[i]
            bm.allocate(seq, num_new, cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            in_flight.update(self._in_flight(seq))
            self._parts_in_flight(seq, parts)
            if holders is not None:
                self._hold(holders, seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def _in_flight(self, seq: Sequence) -> list:
        """The keys of what `seq`'s prefill is computing that a waiting sequence could share once computed: its
        prompt's full blocks not yet cached, the start of each block it has not yet computed (bm.part_key), and its
        prompt's last tokens (bm.tail_key) until they are computed."""
        bm = self.block_manager
        keys: list = bm.blocks_in_flight(seq)
        computed, last = seq.num_computed_tokens, seq.num_prompt_tokens - 1
        if computed < last:
            first = computed // bm.block_size + (computed % bm.block_size >= PARTIAL_MIN_TOKENS)
            keys += (key for place in range(first, last // bm.block_size + 1)
                     if (key := bm.part_key(seq, place)) is not None)
            if (tail := bm.tail_key(seq)) is not None:
                keys.append(tail)
        return keys

    def _parts_in_flight(self, seq: Sequence, parts: dict[tuple, list]) -> None:
        """Into parts (part_key -> token runs): the prompt blocks `seq`'s prefill has yet to finish, each as the
        tokens it will hold once computed."""
        bm = self.block_manager
        computed, last, bs = seq.num_computed_tokens, seq.num_prompt_tokens - 1, bm.block_size
        if computed >= last:
            return
        ids = seq.prompt_token_ids
        for place in range(computed // bs, last // bs + 1):
            if (key := bm.part_key(seq, place)) is not None:
                parts.setdefault(key, []).append(ids[place * bs:(place + 1) * bs])

    def _longer_in_flight(self, seq: Sequence, cached: CachedPrefix, runs: list) -> bool:
        """Whether a block in flight (runs: its tokens) will share PARTIAL_MIN_TOKENS more of the block after
        `seq`'s cached prefix than the partial copy `cached` found now."""
        bs = self.block_manager.block_size
        start = len(cached) * bs
        mine = seq.token_ids[start:start + min(bs - 1, seq.num_tokens - 1 - start)]
        want = cached.partial + PARTIAL_MIN_TOKENS
        if len(mine) < want:
            return False
        return any(run[:want] == mine[:want] for run in runs)

    def _holders(self) -> dict[int, int]:
        holders: dict[int, int] = {}
        for seq in self.running:
            self._hold(holders, seq)
        return holders

    def _hold(self, holders: dict[int, int], seq: Sequence) -> None:
        steps = self.admission.remaining_steps(seq)
        for block_id in seq.block_table:
            if holders.get(block_id, -1) < steps:
                holders[block_id] = steps

    def _shared_tokens(self, seq: Sequence, cached: CachedPrefix, holders: dict[int, int]) -> int:
        """The leading tokens of `seq`'s cached prefix whose blocks a running sequence holds that ends no sooner
        than `seq` is expected to (a block deeper in a prefix has no more holders than one before it)."""
        steps = self.admission.remaining_steps(seq)
        shared = 0
        for block_id in cached.tables[0]:
            if holders.get(block_id, -1) < steps:
                break
            shared += 1
        return shared * self.block_manager.block_size

    def update(self, out: SchedulerOutput, rejected: dict[int, int] | None = None) -> None:
        """After the model ran `out`: each scheduled sequence's computed tokens advance by what it was given, less
        its draft tokens the model did not confirm (rejected: id(seq) -> how many; the engine has put the confirmed
        ones in its token_ids), its blocks that are now full enter the prefix cache, and a sliding group's blocks that
        fell out of its window go back to the free list. (Finishing is `finish`, once sampled.)"""
        bm = self.block_manager
        slides = bm.layout.slides
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - (rejected.get(id(s.seq), 0) if rejected else 0)
            s.seq.draft = []
            bm.cache_full_blocks(s.seq)
            if slides:
                bm.free_outside_windows(s.seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence: out of the queues, its blocks released (full ones stay in the prefix cache)."""
        assert status.is_finished
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        self._finished_since_admission = True
        if self.admission is not None and status != SequenceStatus.FINISHED_ABORTED:
            self.admission.observe_finished(seq.num_output_tokens, seq.params.max_new_tokens, seq.params.ignore_eos)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft = []
        seq.num_shared_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

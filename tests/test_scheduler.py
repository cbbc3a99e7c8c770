"""Scheduler: token budget, chunked prefill, who is preempted, and the waiting order after it."""

from __future__ import annotations

from bulkgen.config import SamplingParams
from bulkgen.engine.block_manager import BlockManager
from bulkgen.engine.scheduler import Scheduler
from bulkgen.engine.sequence import Sequence, SequenceStatus


def make(num_blocks: int = 8, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def seq(request_id: int, n: int) -> Sequence:
    return Sequence(request_id, list(range(1000 * request_id, 1000 * request_id + n)), SamplingParams())


def run(sched: Scheduler, sampled_token: int = 7) -> list[tuple[int, int]]:
    """One step as the engine runs it, without a model: returns [(request_id, num_new_tokens)]."""
    out = sched.schedule()
    sched.update(out)
    for s in out.scheduled:
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.append_token(sampled_token)
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def test_prefill_then_decode_in_one_budget() -> None:
    sched = make(budget=10)
    a, b = seq(1, 6), seq(2, 6)
    sched.add(a)
    sched.add(b)
    assert run(sched) == [(1, 6), (2, 4)]  # b's prompt is chunked: 4 of 6 tokens fit
    assert b.num_computed_tokens == 4 and b.num_output_tokens == 0
    assert run(sched) == [(1, 1), (2, 2)]  # a decodes while b finishes its prompt
    assert b.num_output_tokens == 1
    assert run(sched) == [(1, 1), (2, 1)]


def test_max_num_seqs_caps_admission() -> None:
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.add(seq(i, 2))
    assert [r for r, _ in run(sched)] == [0, 1]
    assert [s.request_id for s in sched.waiting] == [2]


def test_admission_stops_at_the_first_request_that_does_not_fit() -> None:
    sched = make(num_blocks=4)
    sched.add(seq(1, 9))  # 3 blocks
    sched.add(seq(2, 8))  # 2 blocks: does not fit in the 1 left
    sched.add(seq(3, 2))  # would fit, but admission is in order
    assert run(sched) == [(1, 9)]
    assert [s.request_id for s in sched.waiting] == [2, 3]


def test_the_most_recently_admitted_is_preempted_and_requeued_first() -> None:
    sched = make(num_blocks=4)
    a, b, c = seq(1, 4), seq(2, 4), seq(3, 4)
    for s in (a, b, c):
        sched.add(s)
    assert run(sched) == [(1, 4), (2, 4), (3, 4)]  # 3 blocks, each full
    assert sched.block_manager.free_block_ids == [3]
    # Each now needs a 5th slot: a takes block 3; b needs one more: c (last admitted) is preempted.
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1), (2, 1)]
    assert out.preempted == [c] and c.status == SequenceStatus.PREEMPTED
    assert a.block_table == [0, 3] and b.block_table == [1, 2]
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert list(sched.waiting) == [c] and sched.num_preemptions == 1


def test_a_sequence_preempts_itself_when_it_is_the_last() -> None:
    sched = make(num_blocks=2)
    a, b = seq(1, 4), seq(2, 4)
    sched.add(a)
    sched.add(b)
    run(sched)
    out = sched.schedule()  # a needs a block: b is preempted; then there is one for a
    assert [s.seq for s in out.scheduled] == [a] and out.preempted == [b]
    sched.update(out)
    for s in out.scheduled:
        s.seq.append_token(7)
    # a needs yet another block (9 tokens in 2 blocks of 4): nobody else runs, so a preempts itself.
    a.token_ids += [8, 8, 8]
    a.num_computed_tokens = 8
    out = sched.schedule()
    assert out.scheduled == [] and out.preempted == [a]
    assert [s.request_id for s in sched.waiting] == [1, 2]


def test_recompute_after_preemption_uses_the_prefix_cache() -> None:
    sched = make(num_blocks=4)
    a, b = seq(1, 8), seq(2, 5)
    sched.add(a)
    sched.add(b)
    run(sched)  # a: blocks 0, 1 (full, cached); b: blocks 2, 3
    for s in (a, b):
        sched.block_manager.cache_full_blocks(s)
    out = sched.schedule()  # a needs a 3rd block for its 9th token: b is preempted
    assert out.preempted == [b]
    sched.update(out)
    for s in out.scheduled:
        s.seq.append_token(9)
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    out = sched.schedule()  # b comes back: its first full block is still cached
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [(2, 2)]
    assert b.num_computed_tokens == 4 and b.num_cached_tokens == 0  # a recompute is not a cache hit


def test_finish_frees_blocks_and_leaves_the_queues() -> None:
    sched = make()
    a = seq(1, 5)
    sched.add(a)
    run(sched)
    sched.finish(a, SequenceStatus.FINISHED_EOS)
    assert not sched.has_unfinished() and a.is_finished and a.finish_reason == "eos"
    assert sched.block_manager.num_free_blocks == 8


def test_a_prompts_samples_compute_its_tokens_once() -> None:
    """Four samples of one prompt (`--n 4`), queued together: one computes the prompt while the others wait a step,
    then each takes its full blocks from the prefix cache and copies the rest of its last block from the first's
    (open, not yet full), computing only the last token."""
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=256)
    prompt = list(range(100, 140))  # 2 full blocks and 8 tokens
    samples = [Sequence(i, prompt, SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    other = Sequence(9, list(range(500, 540)), SamplingParams())
    for s in [*samples, other]:
        sched.add(s)
    assert run(sched) == [(0, 40)]  # (in strict order, without the packer's lookahead, the next prompt waits too)
    assert run(sched) == [(0, 1), (1, 1), (2, 1), (3, 1), (9, 40)]
    assert [s.num_cached_tokens for s in samples] == [0, 39, 39, 39]
    copies = sched.block_manager.take_copies()
    assert copies == [(samples[0].block_table[2], s.block_table[2]) for s in samples[1:]]
    # freed, the first sample's last block still serves a later copy of the prompt, until it is handed out again
    for s in samples:
        sched.finish(s, SequenceStatus.FINISHED_LENGTH)
    again = Sequence(5, prompt, SamplingParams())
    sched.add(again)
    run(sched)
    assert again.num_cached_tokens == 39


def test_a_question_waits_a_step_for_one_in_flight_that_begins_alike() -> None:
    """Two questions about one cached document that begin with the same words, admitted together: the first copies
    the document's last tokens (the only copy there is) and computes its own; the second waits a step for the first's
    block rather than compute the shared words beside it, then copies them too."""
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=8, max_num_batched_tokens=256)
    doc = list(range(100, 136))  # 2 full blocks and 4 tokens
    reader = Sequence(0, [*doc, 900, 901, 902], SamplingParams())
    sched.add(reader)
    run(sched)
    words = list(range(10, 16))
    first, second = (Sequence(i, [*doc, *words, 20 * i, 20 * i + 1], SamplingParams()) for i in (1, 2))
    sched.add(first)
    sched.add(second)
    assert run(sched) == [(0, 1), (1, 8)]  # 4 of the document's last block copied, 8 of its own computed
    assert run(sched) == [(0, 1), (1, 1), (2, 2)]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (36, 42)

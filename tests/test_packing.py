"""The packer: admission order per packing, and the projected-peak KV admission."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from bulkgen.config import SamplingParams
from bulkgen.engine.block_manager import BlockManager
from bulkgen.engine.scheduler import Scheduler
from bulkgen.engine.sequence import Sequence
from bulkgen.errors import ConfigError
from bulkgen.packing import KVAdmission, admission_for, order, peak_blocks


@dataclass
class Item:
    name: str
    num_prompt_tokens: int
    max_new_tokens: int


ITEMS = [Item("a", 100, 16), Item("b", 10, 256), Item("c", 500, 64), Item("d", 50, 256), Item("e", 500, 16)]


def test_orders() -> None:
    assert [i.name for i in order(ITEMS, "fifo")] == ["a", "b", "c", "d", "e"]
    assert [i.name for i in order(ITEMS, "sorted")] == ["b", "d", "a", "c", "e"]
    # most output tokens first (the decode chain is what makes a tail), longer prompt first on ties
    assert [i.name for i in order(ITEMS, "lpt")] == ["d", "b", "c", "e", "a"]
    with pytest.raises(ConfigError, match="--packing must be one of"):
        order(ITEMS, "random")


def test_peak_blocks_is_at_a_finish() -> None:
    # one sequence: 10 tokens now, 6 to come -> 16 tokens at its end -> 1 block + half-block margin
    assert peak_blocks([(10, 6)], 16) == 2
    # two sequences: A 30 now + 2 to come, B 2 now + 40 to come.
    # At t=2 (A's end): 32 + 4 = 36 tokens; at t=40 only B: 42 tokens -> the later peak wins.
    assert peak_blocks([(30, 2), (2, 40)], 4) == max(-(-(36 + 4) // 4), -(-(42 + 2) // 4))
    assert peak_blocks([], 16) == 0


def test_peak_blocks_counts_a_sliding_group_at_its_window() -> None:
    """A full group and two sliding ones (window 24 in blocks of 16: at most 3 blocks a sequence)."""
    groups = (0, 24, 24)
    assert peak_blocks([(10, 90)], 16, groups) == peak_blocks([(10, 90)], 16) + 2 * 3
    assert peak_blocks([(10, 6)], 16, groups) == 2 + 2 * 1  # short: a sliding group holds what a full one does
    assert peak_blocks([(10, 90)], 16, (24,)) == 3  # every layer slides


def _seq(request_id: int, prompt: int, max_new: int) -> Sequence:
    return Sequence(request_id, list(range(prompt)), SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def test_kv_admission_holds_back_what_would_need_preemption() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)  # 80 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256, admission=KVAdmission(20, 4))
    a, b, c = _seq(1, 20, 20), _seq(2, 20, 20), _seq(3, 4, 4)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a alone ends at 40 tokens; a and b together would end at 80 tokens + margin > 80: b waits.
    # The blocks are there now (5 + 5 of 20), but b would force a preemption later. c, small and
    # short, fits beside a: the scheduler looks past b for it.
    assert [s.seq.request_id for s in out.scheduled] == [1, 3]
    assert [s.request_id for s in sched.waiting] == [2]


def test_strict_order_without_lookahead() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256,
                      admission=KVAdmission(20, 4, lookahead=1))
    for s in (_seq(1, 20, 20), _seq(2, 20, 20), _seq(3, 4, 4)):
        sched.add(s)
    assert [s.seq.request_id for s in sched.schedule().scheduled] == [1]
    assert [s.request_id for s in sched.waiting] == [2, 3]


def test_kv_admission_learns_the_output_share() -> None:
    admission = KVAdmission(num_blocks=100, block_size=16)
    for _ in range(20):
        admission.observe_finished(num_output_tokens=25, max_new_tokens=100, ignore_eos=False)
    assert admission.output_share == pytest.approx(0.25)
    admission.observe_finished(num_output_tokens=5, max_new_tokens=100, ignore_eos=True)  # not learned from
    assert admission.output_share == pytest.approx(0.25)


def _running(request_id: int, prompt: int, max_new: int, done: int) -> Sequence:
    seq = _seq(request_id, prompt, max_new)
    for _ in range(done):
        seq.append_token(7)
    return seq


def test_spreading_ends_reorders_the_longer_half_of_the_queue() -> None:
    admission = KVAdmission(num_blocks=100, block_size=16, spread_ends=True)
    running = [_running(90, 10, 110, 10), _running(91, 10, 100, 5)]  # 100 and 95 steps left
    waiting = deque(_seq(i, 10, n) for i, n in enumerate([100, 97, 60, 50, 10, 5]))
    admission.prioritize(waiting, running)
    # spacing = mean remaining (53.7) / 2 running = 26.8: of the longer half, 60 ends 35 steps from
    # the nearest running end; 100 and 97 would end with the running ones. The shorter half stays.
    assert [s.params.max_new_tokens for s in waiting] == [60, 100, 97, 50, 10, 5]


def test_spreading_ends_keeps_preempted_sequences_first_and_is_off_by_default() -> None:
    running = [_running(90, 10, 110, 10)]
    preempted = _seq(9, 10, 100)
    preempted.num_preemptions = 1
    for spread, want in ((True, [100, 40, 100, 90, 30, 1, 1]), (False, [100, 100, 90, 40, 30, 1, 1])):
        waiting = deque([preempted, *(_seq(i, 10, n) for i, n in enumerate([100, 90, 40, 30, 1, 1]))])
        KVAdmission(num_blocks=100, block_size=16, spread_ends=spread).prioritize(waiting, running)
        assert waiting[0] is preempted
        assert [s.params.max_new_tokens for s in waiting] == want


def test_packing_removes_preemption_under_a_tight_cache(tiny_model_dir) -> None:
    import random

    from bulkgen.config import EngineConfig
    from bulkgen.engine.engine import Engine

    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(10, 200))] for _ in range(30)]
    params = [SamplingParams(max_new_tokens=rng.randint(8, 80), ignore_eos=True) for _ in prompts]
    results = {}
    for admission in (False, True, "spread"):
        engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=600 * 512, block_size=8, max_num_seqs=32),
                        admission=admission_for("lpt" if admission == "spread" else "fifo", bool(admission)))
        assert (engine.scheduler.admission is not None) == bool(admission)
        outs = {o.request_id: o.output_token_ids for o in engine.generate(prompts, params)}
        results[admission] = (engine.stats.num_preemptions, outs)
    assert results[False][0] > 0 and results[True][0] == 0 and results["spread"][0] == 0
    assert results[False][1] == results[True][1] == results["spread"][1]

"""The packer: admission order per packing, and the projected-peak KV admission."""

from __future__ import annotations

import random
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


@dataclass
class Prompted:
    ids: list[int]
    max_new_tokens: int
    group: tuple[int, ...] = ()  # the documents it shares, outermost first (what the test built, not what it finds)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.ids)


def _lpt_key(item: Prompted) -> tuple[int, int]:
    return -item.max_new_tokens, -item.num_prompt_tokens


def _fewshot(rng: random.Random, header: list[int], documents: int, questions: int) -> list[Prompted]:
    items = []
    for d in range(documents):
        document = [rng.randrange(1000, 50_000) for _ in range(rng.randint(100, 300))]
        for _ in range(questions):
            question = [rng.randrange(1000, 50_000) for _ in range(rng.randint(3, 30))]
            items.append(Prompted(header + document + question, rng.randint(8, 256), (d,)))
    rng.shuffle(items)
    return items


def test_prefix_order_is_lpt_where_prompts_share_little() -> None:
    """A chat template's few tokens shared by every prompt, and chance shared starts, make no group: the order is
    lpt's as it was (the same function without the prompts)."""
    rng = random.Random(0)
    header = list(range(1, 21))
    items = [Prompted(header + [rng.randrange(1000, 1010) for _ in range(rng.randint(1, 200))], rng.randint(8, 256))
             for _ in range(300)]
    assert order(items, "lpt", prompt_ids=lambda it: it.ids) == order(items, "lpt")
    assert order(items, "fifo", prompt_ids=lambda it: it.ids) == items, "only lpt groups"


def test_prefix_order_runs_each_document_as_one_group_in_lpt_order() -> None:
    rng = random.Random(1)
    items = _fewshot(rng, list(range(1, 21)), documents=6, questions=12)
    got = order(items, "lpt", prompt_ids=lambda it: it.ids)
    # the reference, from how the items were built: each document's questions in lpt order, the documents in the
    # order of their first question's key (ties: the earlier input first, as the keys' last field says)
    position = {id(it): i for i, it in enumerate(items)}
    groups: dict[tuple[int, ...], list[Prompted]] = {}
    for item in items:
        groups.setdefault(item.group, []).append(item)
    members = [sorted(g, key=lambda it: (*_lpt_key(it), position[id(it)])) for g in groups.values()]
    members.sort(key=lambda g: (*_lpt_key(g[0]), position[id(g[0])]))
    assert got == [it for g in members for it in g]


def test_prefix_order_nests_groups_and_keeps_samples_of_one_prompt_together() -> None:
    """A long system prompt shared by half the documents, the documents within it, and four samples of a prompt."""
    rng = random.Random(2)
    system = [rng.randrange(1000, 50_000) for _ in range(150)]
    inner = _fewshot(rng, system, documents=3, questions=5)
    outer = _fewshot(rng, [7, 8, 9], documents=3, questions=5)
    for item in outer:
        item.group = (item.group[0] + 10,)
    samples = [Prompted(list(range(500, 700)), 100 + i) for i in range(4)]
    items = inner + outer + samples
    rng.shuffle(items)
    got = order(items, "lpt", prompt_ids=lambda it: it.ids)

    def runs(label) -> int:  # how many separate runs the items with this label make in the order
        flags = [label(it) for it in got]
        return sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))

    assert runs(lambda it: it.ids[:150] == system) == 1, "the system prompt's requests run as one group"
    for d in range(3):
        assert runs(lambda it, d=d: it.group == (d,) and it.ids[:150] == system) == 1
        assert runs(lambda it, d=d: it.group == (d + 10,)) == 1
    assert runs(lambda it: it in samples) == 1
    assert len(got) == len(items) and {id(it) for it in got} == {id(it) for it in items}


def test_a_prompt_waits_for_the_prefix_a_running_sequence_is_computing() -> None:
    """Two prompts sharing 4 blocks, admitted in one step, would both compute them: the second waits a step and
    takes them from the prefix cache; an unrelated prompt behind it is not held up."""
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256, admission=KVAdmission(64, 4))
    shared = list(range(100, 116))
    first = Sequence(1, shared + [1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    second = Sequence(2, shared + [4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True))
    other = Sequence(3, list(range(200, 219)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    for s in (first, second, other):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == [1, 3]
    sched.update(out)
    first.append_token(7)
    other.append_token(7)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == [1, 3, 2]
    assert second.num_cached_tokens == 16 and out.scheduled[-1].num_new_tokens == 2


def test_claims_follow_the_prefix_groups_through_the_queue(db_url: str) -> None:
    """A few-shot job in the store (SQLite and PostgreSQL): claims five at a time under lpt come in the order that
    packing.order gives the same requests in memory (every key distinct, so ties cannot differ), each document's
    questions together; fifo and sorted are untouched."""
    from bulkgen.store import jobs as job_ops
    from bulkgen.store import queue as q
    from bulkgen.store.db import open_store

    rng = random.Random(3)
    items = _fewshot(rng, list(range(1, 21)), documents=4, questions=6)
    for budget, item in zip(rng.sample(range(8, 1000), len(items)), items, strict=True):
        item.max_new_tokens = budget
    store = open_store(db_url)
    with store.session_scope(write=True) as session:
        job_id = job_ops.new_job(session, model="m", model_path="m", spec={})
        job_ops.insert_requests(session, [job_ops.request_row(job_id, row, 0, item.ids, item.max_new_tokens, row)
                                          for row, item in enumerate(items)])
        job_ops.open_job(session, job_id, len(items))
    claimed: list[int] = []
    while True:
        with store.session_scope(write=True) as session:
            rows = q.claim(session, "w", [job_id], 5, lease_s=60)
        if not rows:
            break
        claimed += [r.row for r in rows]
        # a claim of 5 that ends inside a document's 6 questions takes the rest of them: no group is split
        assert len(rows) in (5, 6, 7, 8, 9, 10) or not any(r.state == "pending" for r in _requests(store, job_id))
        assert not {items[rows[-1].row].group} & {items[r.row].group for r in _requests(store, job_id)
                                                     if r.state == "pending"}
    expected = order(list(range(len(items))), "lpt", prompt_len=lambda i: items[i].num_prompt_tokens,
                     max_new=lambda i: items[i].max_new_tokens, prompt_ids=lambda i: items[i].ids)
    assert claimed == expected
    assert sum(1 for a, b in zip(claimed, claimed[1:], strict=False) if items[a].group != items[b].group) == 3


def _requests(store, job_id: int) -> list:
    from sqlalchemy import select

    from bulkgen.store.models import Request

    with store.session_scope() as session:
        return list(session.scalars(select(Request).where(Request.job_id == job_id)))

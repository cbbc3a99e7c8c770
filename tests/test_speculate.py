"""Drafts (engine/speculate.py) change no output. References: Hugging Face generate() for greedy rows on every
path (C, torch, Hugging Face's modules, the Triton interpreter); decoding without drafts for sampled rows (a draw is
keyed by its position, so the same tokens come out); jsonschema for constrained rows. Drafts are given by an oracle
that knows the reference output, whole or with a wrong token, so that every way a draft is kept or cut is run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.engine.sequence import Sequence
from bulkgen.engine.speculate import MAX_DRAFT, Drafter, NgramIndex, OutputIndex, Speculation
from tests import helpers

rng = random.Random(3)
WORKLOAD = [([rng.randrange(100, 40000) for _ in range(n)], m)
            for n, m in ((1, 20), (5, 33), (31, 9), (40, 2), (70, 40), (130, 17), (17, 25), (3, 1))]


class Oracle(Drafter):
    """Drafts the reference continuation of each request, with its `wrong`-th token changed (None: right)."""

    def __init__(self, engine: Engine, reference: dict[int, list[int]], wrong: int | None, length: int) -> None:
        super().__init__(engine.speculation, engine.tokenizer, engine.eos_token_ids)
        self.reference, self.wrong, self.length = reference, wrong, length

    def propose(self, running: list[Sequence], max_new_room) -> None:
        for seq in running:
            if seq.num_uncomputed_tokens != 1 or not seq.num_output_tokens:
                continue
            done = seq.num_output_tokens
            draft = list(self.reference[seq.request_id][done:done + min(self.length, max_new_room(seq) - 1)])
            if self.wrong is not None and self.wrong < len(draft):
                draft[self.wrong] = draft[self.wrong] + 1
            seq.draft, seq.draft_source = draft, "prompt"


def _run(engine: Engine, workload: list, params: list[SamplingParams]) -> dict[int, list[int]]:
    outputs = {o.request_id: o for o in engine.generate([p for p, _ in workload], params)}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return {i: o.output_token_ids for i, o in outputs.items()}


@pytest.fixture(scope="module")
def references(tiny_model_dir: Path, tiny_qwen2_dir: Path) -> dict[str, tuple[Path, dict[int, list[int]]]]:
    return {name: (path, dict(enumerate(helpers.hf_greedy(path, WORKLOAD))))
            for name, path in (("llama", tiny_model_dir), ("qwen2", tiny_qwen2_dir))}


PATHS = {"c": dict(kernels="c"), "torch": dict(kernels="torch"), "hf-modules": dict(fast_forward=False),
         "triton-interpreter": dict(attention_backend="triton", block_size=16)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_drafts_equals_hf_generate(references, family: str, path: str) -> None:
    """Right drafts, drafts wrong at their first or fourth token, under a token budget that cuts drafts short
    (chunked) and one that does not."""
    model_dir, expected = references[family]
    if path == "triton-interpreter" and family == "qwen2":
        pytest.skip("the interpreter is slow: one family there (the C and torch paths run both)")
    cases = [(None, MAX_DRAFT, 1024), (0, 4, 1024), (3, MAX_DRAFT, 1024), (None, 6, 12)]
    workload = WORKLOAD
    if path == "triton-interpreter":  # the interpreter is slow: the case that keeps, cuts and trims drafts, on
        # short outputs (greedy outputs are prefixes of longer ones)
        cases, workload = [(3, MAX_DRAFT, 12)], [(p, min(m, 12)) for p, m in WORKLOAD[:4]]
    elif path == "hf-modules":  # Hugging Face's modules see the same steps as the lean forward: two cases
        cases = cases[1:3]
    for wrong, length, budget in cases:
        engine = Engine(model_dir, EngineConfig(**{**dict(max_num_seqs=8, max_num_batched_tokens=budget, block_size=8,
                                                          kv_cache_memory=4 << 20), **PATHS[path]}))
        engine.drafter = Oracle(engine, expected, wrong, length)
        got = _run(engine, workload, [SamplingParams(max_new_tokens=m) for _, m in workload])
        assert got == {i: expected[i][:m] for i, (_, m) in enumerate(workload)}, (wrong, length, budget)
        stats = engine.stats
        assert stats.num_draft_tokens > 0
        if wrong is None:  # every right token is kept
            assert stats.num_accepted_tokens == stats.num_draft_tokens
            assert stats.num_steps < sum(m for _, m in workload) / 2 + len(workload)
        else:
            assert stats.num_accepted_tokens < stats.num_draft_tokens


def test_sampled_rows_give_the_same_tokens_with_drafts_and_without(tiny_model_dir: Path) -> None:
    """A draw is keyed by its position: the tokens a seeded request samples do not depend on drafts, kept or not
    (temperature alone, top-k, top-p, min-p)."""
    settings = [dict(temperature=0.9), dict(temperature=0.7, top_k=20), dict(temperature=1.0, top_p=0.8),
                dict(temperature=1.2, min_p=0.05)]
    params = [SamplingParams(max_new_tokens=m, seed=7 + i, **settings[i % len(settings)])
              for i, (_, m) in enumerate(WORKLOAD)]
    config = EngineConfig(max_num_seqs=8, block_size=8, kv_cache_memory=4 << 20)
    plain = _run(Engine(tiny_model_dir, EngineConfig(**{**config.__dict__, "speculate": "off"})), WORKLOAD, params)
    assert any(len(set(out)) > 2 for out in plain.values()), "the rows were drawn"
    for wrong in (None, 2):
        engine = Engine(tiny_model_dir, config)
        engine.drafter = Oracle(engine, plain, wrong, MAX_DRAFT)
        assert _run(engine, WORKLOAD, params) == plain
        assert engine.stats.num_accepted_tokens > 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "city": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "member": {"type": "boolean"},
                                           "kind": {"enum": ["alpha", "beta"]}},
          "required": ["name", "city", "age", "member", "kind"], "additionalProperties": False}


@pytest.mark.parametrize("sampled", [False, True])
def test_a_schema_s_forced_tokens_are_drafted_and_change_nothing(tiny_model_dir: Path, sampled: bool) -> None:
    """The grammar drafter proposes the schema's forced keys; the outputs equal those without drafts, token for
    token, and every complete one validates."""
    schema = json.dumps(SCHEMA)
    knobs = dict(temperature=0.8, seed=5) if sampled else {}
    params = [SamplingParams(max_new_tokens=90, json_schema=schema, **knobs) for _ in WORKLOAD]
    outputs = {}
    for speculate in ("off", "auto"):
        engine = Engine(tiny_model_dir, EngineConfig(max_num_seqs=8, block_size=8, kv_cache_memory=4 << 20,
                                                     speculate=speculate))
        got = {o.request_id: o for o in engine.generate([p for p, _ in WORKLOAD], params)}
        outputs[speculate] = {i: o.output_token_ids for i, o in got.items()}
        if speculate == "auto":
            drafted, kept = engine.drafter.by_source["grammar"]
            assert kept > 0 and engine.stats.num_steps < sum(len(t) for t in outputs["off"].values())
            complete = [o for o in got.values() if o.finish_reason == "stop"]
            assert complete
            for o in complete:
                jsonschema.validate(json.loads(o.text), SCHEMA)
    assert outputs["auto"] == outputs["off"]


def test_the_lookups_find_the_latest_earlier_occurrence_and_the_output_index_stays_bounded() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    index.extend(tokens)
    assert index.lookup(tokens, 3) == [5, 6, 2]  # "2 3" last seen before 5 (3-gram "6 2 3" never was)
    assert index.lookup(tokens + [7], 3) == []
    tokens += [5, 6]
    index.extend(tokens)
    assert index.lookup(tokens, 2) == [2, 3]  # "3 5 6" was followed by 2 3
    outputs = OutputIndex(entries=10)
    for start in range(0, 400, 20):
        outputs.add(list(range(start, start + 20)))
    assert all(len(table) <= 10 for table in outputs.tables.values())
    assert outputs.lookup([397, 398], 4) == [399] and outputs.lookup([5, 6], 4) == []


def test_drafts_are_as_long_as_their_acceptance_pays_for_in_the_step() -> None:
    """The step cost is fitted as a plane (10 ms, 1 ms a token, 0.5 ms a sampled row); the k-th token is drafted
    where acceptance^k beats the share of the step one sampled row costs: long drafts in small steps, none in full
    steps whose rows cost nearly all of them."""
    speculation = Speculation("auto")
    for n, rows in ((1, 1), (4, 4), (300, 2), (64, 64), (256, 200), (40, 20)) * 4:
        speculation.observe_step(n, rows, 0.010 + 0.001 * n + 0.0005 * rows)
    a, b, d = speculation.costs()
    assert (a, b, d) == (pytest.approx(0.010, rel=1e-3), pytest.approx(0.001, rel=1e-3),
                         pytest.approx(0.0005, rel=1e-3))
    for _ in range(200):
        speculation.observe_draft("prompt", 4, 3)  # 3 of 4 kept: acceptance 3/4
    assert speculation.plan(1)["prompt"] == 7  # a row is 1.5/11.5 of a step: 0.75^7 > 0.13 > 0.75^8
    assert speculation.plan(256) == {"prompt": 0, "grammar": 0, "outputs": 0}  # 384/394 of it
    assert Speculation("off").enabled is False

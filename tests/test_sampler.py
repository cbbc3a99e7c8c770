"""Sampling: per-request seeds independent of the batch, the filters, repetition penalty, logprobs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.engine.sampler import sample_row


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(tiny_model_dir, EngineConfig(kv_cache_memory=32 * 2**20))


def _run(engine: Engine, requests: dict) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add(request_id, prompt, params)
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, o) for o in engine.step())
    return out


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(engine: Engine) -> None:
    rng = random.Random(3)
    target = ([rng.randrange(100, 40000) for _ in range(40)],
              SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True))
    alone = _run(engine, {"target": target})["target"].output_token_ids
    others = {f"other-{i}": ([rng.randrange(100, 40000) for _ in range(rng.randint(1, 120))],
                             SamplingParams(max_new_tokens=rng.randint(5, 40), temperature=0.8, seed=i))
              for i in range(16)}
    batched = _run(engine, {**others, "target": target})["target"].output_token_ids
    assert batched == alone and len(alone) == 30
    reseeded = _run(engine, {"target": (target[0], target[1].replace(seed=99))})["target"].output_token_ids
    assert reseeded != alone


def test_top_k_one_is_greedy(engine: Engine) -> None:
    prompt = list(range(300, 340))
    greedy = _run(engine, {0: (prompt, SamplingParams(max_new_tokens=12))})[0].output_token_ids
    top1 = _run(engine, {0: (prompt, SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=5))})
    assert top1[0].output_token_ids == greedy


def test_filters_keep_only_allowed_tokens() -> None:
    logits = torch.tensor([2.0, 1.9, 0.5, -1.0, -3.0])
    gen = torch.Generator().manual_seed(0)
    draws = {sample_row(logits, SamplingParams(temperature=1.0, top_k=2, seed=0), gen) for _ in range(200)}
    assert draws == {0, 1}
    draws = {sample_row(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=0), gen) for _ in range(200)}
    assert draws <= {0, 1} and 0 in draws
    draws = {sample_row(logits, SamplingParams(temperature=1.0, min_p=0.5, seed=0), gen) for _ in range(200)}
    assert draws == {0, 1}  # p(2)/p(0) = e^-1.5 < 0.5
    draws = {sample_row(logits, SamplingParams(temperature=1.0, seed=0), gen) for _ in range(2000)}
    assert draws == {0, 1, 2, 3, 4}


def test_repetition_penalty_matches_hugging_face(tiny_model_dir: Path, engine: Engine) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = [500, 501, 502, 500, 501, 502, 500, 501]
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              repetition_penalty=1.5)[0, len(prompt):].tolist()
    got = _run(engine, {0: (prompt, SamplingParams(max_new_tokens=20, repetition_penalty=1.5))})[0]
    assert got.output_token_ids == expected


def test_logprobs_of_chosen_tokens_and_alternatives(engine: Engine) -> None:
    out = _run(engine, {0: (list(range(700, 720)), SamplingParams(max_new_tokens=5, logprobs=3))})[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.output_token_ids, out.logprobs, strict=True):
        assert entry["token"] == token and entry["logprob"] <= 0
        assert entry["top"][0][0] == token  # greedy: the chosen token is the most likely
        assert [lp for _, lp in entry["top"]] == sorted((lp for _, lp in entry["top"]), reverse=True)


def test_rows_with_different_settings_in_one_batch_keep_their_own_filters() -> None:
    """One batched draw: each row's temperature, top-k, min-p and top-p act on that row alone."""
    from bulkgen.engine.sampler import sample_rows

    logits = torch.tensor([2.0, 1.9, 0.5, -1.0, -3.0]).repeat(4, 1)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=5.0)]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    draws: list[set[int]] = [set() for _ in params]
    for _ in range(400):
        for row, token in enumerate(sample_rows(logits, params, generators).tolist()):
            draws[row].add(token)
    assert draws[0] == {0, 1} and draws[1] <= {0, 1} and draws[2] == {0, 1} and draws[3] == {0, 1, 2, 3, 4}


def test_repetition_penalties_of_many_rows_equal_one_row_at_a_time() -> None:
    from bulkgen.engine.sampler import apply_repetition_penalties

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seen = [[1, 2, 2, 40], [], [7]]
    batched = logits.clone()
    apply_repetition_penalties(batched, [0, 1, 2], seen, [1.5, 2.0, 0.5])
    for row, (ids, penalty) in enumerate(zip(seen, [1.5, 2.0, 0.5], strict=True)):
        want = logits[row].clone()
        for token in set(ids):
            want[token] = want[token] * penalty if want[token] < 0 else want[token] / penalty
        assert torch.equal(batched[row], want)


def test_frequency_and_presence_penalties_count_the_output_so_far() -> None:
    from bulkgen.engine.sampler import apply_output_penalties

    logits = torch.zeros(2, 6)
    apply_output_penalties(logits, [0, 1], [[1, 1, 3], []], [0.5, 0.5], [1.0, 1.0])
    assert logits[0].tolist() == [0.0, -2.0, 0.0, -1.5, 0.0, 0.0] and logits[1].tolist() == [0.0] * 6


def test_sample_applies_output_penalties_to_its_rows_only() -> None:
    from bulkgen.engine.sampler import sample
    from bulkgen.engine.sequence import Sequence

    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]] * 2)
    seqs = [Sequence(i, [0], SamplingParams(frequency_penalty=1.0 if i == 0 else 0.0)) for i in range(2)]
    for seq in seqs:
        seq.append_token(1)
        seq.append_token(1)  # token 1 twice in the output: 3 - 2 x 1.0 = 1 < 2
    assert sample(logits.clone(), seqs, set()).token_ids == [2, 1]

"""Sampling: per-request seeds independent of the batch, the filters, repetition penalty, logprobs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.cpu.ops import Ops
from bulkgen.engine.engine import Engine
from bulkgen.engine.sampler import sample_row
from tests.builds import kernel

# the sampler's two ways through the vocabulary: torch's topk and sums, or the C kernels' one pass
on_both_paths = pytest.mark.parametrize("candidates", ["torch", "c"], indirect=True)


@pytest.fixture
def candidates(request: pytest.FixtureRequest):
    return None if request.param == "torch" else Ops(None, torch.float32, sampler=kernel()).candidates


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


# ------------------------------------------------------------------ the distribution, against transformers

def _hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution transformers' own warpers give (temperature, top-k, top-p, min-p, in its order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def _peaked(vocab: int, seed: int) -> torch.Tensor:
    """Logits like a real model's: a few strong tokens, a long tail."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=gen) * 2.5


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_k=300),  # wider than the cut
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1),  # top-p before min-p, as transformers applies them
    SamplingParams(temperature=2.0, top_p=0.99),  # a nucleus wider than the cut: the full-vocabulary path
]


@on_both_paths
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("scale", [1.0, 0.2], ids=["peaked", "flat"])
def test_draws_follow_the_distribution_of_transformers_warpers(params: SamplingParams, scale: float,
                                                               candidates) -> None:
    """4,000 draws (one row each, its own generator) against transformers' probabilities: the same support
    exactly, and frequencies that pass a chi-square test (seeded: the verdict is the same every run)."""
    from bulkgen.engine.sampler import sample_rows

    vocab, num_draws = 2000, 4000
    logits = _peaked(vocab, seed=7) * scale
    expected = _hf_probs(logits, params)
    generators = [torch.Generator().manual_seed(i) for i in range(num_draws)]
    draws = sample_rows(logits.repeat(num_draws, 1), [params] * num_draws, generators, candidates=candidates)
    counts = torch.bincount(draws, minlength=vocab).double()
    support = expected > 0
    assert not counts[~support].any(), "a token outside transformers' kept set was drawn"
    # chi-square over bins of tokens (by falling probability) that each expect at least 20 draws
    order = expected.argsort(descending=True)
    bins = torch.cumsum(expected[order] * num_draws, 0).div(20, rounding_mode="floor").long()
    bins[bins == bins.max()] = max(int(bins.max()) - 1, 0)  # the last, partial bin joins the one before
    observed = torch.zeros(int(bins.max()) + 1, dtype=torch.float64).index_add_(0, bins, counts[order])
    wanted = torch.zeros_like(observed).index_add_(0, bins, expected[order].double() * num_draws)
    keep = wanted > 0
    chi2 = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    dof = int(keep.sum()) - 1
    assert dof >= 3
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))  # chi-square's tail
    assert p_value > 1e-4, (chi2, dof, p_value)


@on_both_paths
def test_the_same_row_draws_the_same_token_whatever_its_batch(candidates) -> None:
    from bulkgen.engine.sampler import sample_rows

    logits = torch.stack([_peaked(2000, seed=s) * scale for s, scale in ((1, 1.0), (2, 0.1), (3, 1.0))])
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=20)]
    together = sample_rows(logits, params, [torch.Generator().manual_seed(5 + i) for i in range(3)],
                           candidates=candidates).tolist()
    alone = [int(sample_rows(logits[i:i + 1], params[i:i + 1], [torch.Generator().manual_seed(5 + i)],
                             candidates=candidates)[0]) for i in range(3)]
    assert together == alone


@on_both_paths
def test_low_temperature_approaches_greedy_and_top_k_one_is_greedy(candidates) -> None:
    from bulkgen.engine.sampler import sample_rows

    logits = _peaked(2000, seed=11)
    generators = [torch.Generator().manual_seed(i) for i in range(200)]
    cold = sample_rows(logits.repeat(200, 1), [SamplingParams(temperature=1e-3)] * 200, generators,
                       candidates=candidates)
    top1 = sample_rows(logits.repeat(200, 1), [SamplingParams(temperature=5.0, top_k=1)] * 200, generators,
                       candidates=candidates)
    assert set(cold.tolist()) == set(top1.tolist()) == {int(logits.argmax())}


@on_both_paths
def test_masked_logits_are_not_a_broken_row_and_a_dead_end_says_so(candidates) -> None:
    """-inf is what masks write: a sampled row with most tokens masked samples among the rest; a row with
    every token masked fails as a dead end of its grammar; NaN or +inf fail as broken, greedy or drawn."""
    from bulkgen.engine.sampler import BROKEN, DEAD_END, sample
    from bulkgen.engine.sequence import Sequence

    vocab = 600
    logits = _peaked(vocab, seed=3).repeat(6, 1)
    logits[0, 10:] = float("-inf")  # a grammar's mask: drawn
    logits[1, 10:] = float("-inf")  # the same, greedy
    logits[2, :] = float("-inf")  # a dead end, drawn
    logits[3, 5] = float("nan")  # broken, drawn
    logits[4, 7] = float("inf")  # broken, greedy
    logits[5, :] = float("-inf")  # a dead end, greedy
    greedy = {1, 4, 5}
    seqs = [Sequence(i, [0], SamplingParams() if i in greedy else SamplingParams(temperature=1.0, seed=i))
            for i in range(6)]
    for seq in seqs:
        seq.matcher = object() if seq.request_id in (2, 5) else None
    result = sample(logits, seqs, set(), candidates=candidates)
    assert result.errors == [None, None, DEAD_END, BROKEN, BROKEN, DEAD_END]
    assert result.token_ids[0] < 10 and result.token_ids[1] == int(logits[1].argmax())


@on_both_paths
def test_a_nucleus_wider_than_every_cut_is_sorted_whole_and_still_exact(candidates) -> None:
    """A flat row of 9,000 tokens at top-p 0.99: wider than the 256 candidates and the 4,096 second cut."""
    from bulkgen.engine.sampler import WIDE_CUT, sample_rows

    vocab, num_draws = 9000, 3000  # 300 draws a bin at least: the chi-squared bound holds at any count
    assert vocab > WIDE_CUT
    logits = _peaked(vocab, seed=5) * 0.05
    params = SamplingParams(temperature=1.0, top_p=0.99)
    expected = _hf_probs(logits, params)
    assert int((expected > 0).sum()) > WIDE_CUT
    generators = [torch.Generator().manual_seed(i) for i in range(num_draws)]
    draws = sample_rows(logits.repeat(num_draws, 1), [params] * num_draws, generators, candidates=candidates)
    counts = torch.bincount(draws, minlength=vocab).double()
    assert not counts[expected == 0].any()
    # the kept mass, in 10 bins of falling probability, against transformers'
    order = expected.argsort(descending=True)
    bins = (torch.cumsum(expected[order], 0) * 10).clamp(max=9.999).long()
    observed = torch.zeros(10, dtype=torch.float64).index_add_(0, bins, counts[order])
    wanted = torch.zeros(10, dtype=torch.float64).index_add_(0, bins, expected[order].double() * num_draws)
    chi2 = float(((observed - wanted) ** 2 / wanted.clamp(min=1e-9)).sum())
    assert chi2 < 30, (observed.tolist(), wanted.tolist())

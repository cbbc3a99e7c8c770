"""Sampling as small pure functions over a step's logits [num_sampled, vocab] (float32).

Each sequence draws from its own torch.Generator, seeded from its request's seed, so a sampled
request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from bulkgen.config import SamplingParams
from bulkgen.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    finite: list[bool]  # False where a row's logits held NaN or inf (that sequence fails)
    logprobs: list[Any]  # per row: None, or {"token": id, "logprob": x, "top": [[id, logprob], ...]}


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int],
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SampleResult:
    """Choose each row's next token. `logits` may be modified in place (masks, penalties) unless a row
    needs them raw (log-probabilities, sampling). `argmax` is row-wise over float32 (torch's by default)."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        return SampleResult([], [], [])
    needs_raw = any(s.params.logprobs is not None or not s.params.is_greedy for s in seqs)
    processed = logits
    masked_rows = [i for i, s in enumerate(seqs) if s.params.ignore_eos]
    if masked_rows and eos_token_ids:
        processed = processed.clone() if needs_raw else processed
        columns = torch.tensor(sorted(eos_token_ids), device=logits.device)
        if len(masked_rows) == num_rows:
            processed[:, columns] = float("-inf")
        else:
            processed[torch.tensor(masked_rows, device=logits.device)[:, None], columns[None, :]] = float("-inf")
    for i, seq in enumerate(seqs):
        if seq.params.repetition_penalty != 1.0:
            if processed is logits and needs_raw:
                processed = processed.clone()
            apply_repetition_penalty(processed[i], seq.token_ids, seq.params.repetition_penalty)
    tokens = [0] * num_rows
    greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    argmax = argmax or (lambda x: x.argmax(dim=-1))
    if len(greedy) == num_rows:
        tokens = argmax(processed).tolist()
    elif greedy:
        chosen = argmax(processed[torch.tensor(greedy, device=logits.device)]).tolist()
        for i, token in zip(greedy, chosen, strict=True):
            tokens[i] = token
    # A NaN or +inf logit wins argmax, so checking the chosen logits finds broken rows cheaply.
    finite = torch.isfinite(processed[torch.arange(num_rows, device=logits.device),
                                      torch.tensor(tokens, device=logits.device)]).tolist()
    for i, seq in enumerate(seqs):
        if not seq.params.is_greedy:
            finite[i] = bool(torch.isfinite(logits[i]).all())
            if finite[i]:
                tokens[i] = sample_row(processed[i], seq.params, seq.generator)
    logprobs = [_logprobs(logits[i], tokens[i], s.params.logprobs) if s.params.logprobs is not None else None
                for i, s in enumerate(seqs)]
    return SampleResult(tokens, finite, logprobs)


def apply_repetition_penalty(row: torch.Tensor, token_ids: list[int], penalty: float) -> None:
    """As in Hugging Face: seen tokens' logits divided by the penalty if positive, multiplied if negative."""
    seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
    scores = row[seen]
    row[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Temperature, then top-k, min-p and top-p filters, then one draw from the sequence's generator."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs > params.top_p * cumulative[-1], 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _logprobs(raw: torch.Tensor, token: int, top: int) -> dict[str, Any]:
    logprobs = torch.log_softmax(raw, dim=-1)
    entry: dict[str, Any] = {"token": token, "logprob": float(logprobs[token])}
    if top:
        values, ids = logprobs.topk(top)
        entry["top"] = [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return entry

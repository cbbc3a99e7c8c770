"""Sampling as small pure functions over a step's logits [num_sampled, vocab] (float32), batched on the
logits' device: masks, penalties, temperature and the top-k / min-p / top-p filters act on all rows at once,
and the step reads back one tensor (the chosen tokens, -1 where a row's logits were not finite). That read
is the step's only synchronisation with a GPU; log-probabilities, where asked for, come back beside it.

Each sequence draws from its own torch.Generator, seeded from its request's seed, so a sampled request gives
the same tokens whatever else shares its batch: its row gets exponential noise from its generator, and the
token is argmax(probs / noise) (an exact draw from probs: the exponential race; one kernel for all rows).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bulkgen.config import SamplingParams
from bulkgen.engine.sequence import Sequence

NOT_FINITE = -1  # the token read back for a row whose logits held NaN or inf


@dataclass
class SampleResult:
    token_ids: list[int]
    finite: list[bool]  # False where a row's logits held NaN or inf (that sequence fails)
    logprobs: list[Any]  # per row: None, or {"token": id, "logprob": x, "top": [[id, logprob], ...]}


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting for the GPU: from pinned memory, asynchronously."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int],
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SampleResult:
    """Choose each row's next token. `logits` may be modified in place (masks, penalties) unless a row
    needs them raw (log-probabilities, sampling). `argmax` is row-wise over float32 (torch's by default)."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        return SampleResult([], [], [])
    device = logits.device
    needs_raw = any(s.params.logprobs is not None or not s.params.is_greedy for s in seqs)
    processed = logits.clone() if needs_raw and _modifies(seqs, eos_token_ids) else logits
    masked_rows = [i for i, s in enumerate(seqs) if s.params.ignore_eos]
    if masked_rows and eos_token_ids:
        columns = to_device(np.array(sorted(eos_token_ids), dtype=np.int64), device)
        if len(masked_rows) == num_rows:
            processed[:, columns] = float("-inf")
        else:
            rows = to_device(np.array(masked_rows, dtype=np.int64), device)
            processed[rows[:, None], columns[None, :]] = float("-inf")
    penalised = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if penalised:
        apply_repetition_penalties(processed, penalised, [seqs[i].token_ids for i in penalised],
                                   [seqs[i].params.repetition_penalty for i in penalised])
    counted = [i for i, s in enumerate(seqs) if s.params.frequency_penalty or s.params.presence_penalty]
    if counted:
        apply_output_penalties(processed, counted, [seqs[i].output_token_ids for i in counted],
                               [seqs[i].params.frequency_penalty for i in counted],
                               [seqs[i].params.presence_penalty for i in counted])
    argmax = argmax or (lambda x: x.argmax(dim=-1))
    drawn = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
    if not drawn:
        tokens = argmax(processed)
        # A NaN or +inf logit wins argmax, so checking the chosen logits finds broken rows cheaply.
        finite = torch.isfinite(processed.gather(1, tokens.to(device)[:, None]))[:, 0]
    else:
        tokens = processed.argmax(dim=-1)
        rows = to_device(np.array(drawn, dtype=np.int64), device)
        raw = logits[rows]
        tokens[rows] = sample_rows(processed[rows], [seqs[i].params for i in drawn],
                                   [seqs[i].generator for i in drawn])
        finite = torch.isfinite(processed.gather(1, tokens[:, None]))[:, 0]
        finite[rows] = torch.isfinite(raw).all(dim=-1)
    chosen = torch.where(finite, tokens.to(device), NOT_FINITE).tolist()  # the step's one read
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    logprobs: list[Any] = [None] * num_rows
    if wanted:
        for i, entry in zip(wanted, _logprobs(logits, wanted, chosen, [seqs[i].params.logprobs for i in wanted]),
                            strict=True):
            logprobs[i] = entry
    return SampleResult([max(t, 0) for t in chosen], [t != NOT_FINITE for t in chosen], logprobs)


def _modifies(seqs: list[Sequence], eos_token_ids: Collection[int]) -> bool:
    return any((s.params.ignore_eos and eos_token_ids) or s.params.repetition_penalty != 1.0
               or s.params.frequency_penalty or s.params.presence_penalty for s in seqs)


def apply_repetition_penalties(logits: torch.Tensor, rows: list[int], token_ids: Seq[Seq[int]],
                               penalties: list[float]) -> None:
    """As in Hugging Face: each row's seen tokens' logits divided by its penalty if positive, multiplied if
    negative. One gather and one scatter for all rows (seen ids padded with the row's first, written twice
    with the same value); a row with no tokens is left alone."""
    kept = [(row, sorted(set(ids)), penalty) for row, ids, penalty in zip(rows, token_ids, penalties, strict=True)
            if ids]
    if not kept:
        return
    rows, seen, penalties = (list(column) for column in zip(*kept, strict=True))
    width = max(len(s) for s in seen)
    index = np.empty((len(rows), width), dtype=np.int64)
    for r, ids in enumerate(seen):
        index[r, :len(ids)] = ids
        index[r, len(ids):] = ids[0]
    device = logits.device
    index_t = to_device(index, device)
    row_t = to_device(np.array(rows, dtype=np.int64), device)
    penalty = to_device(np.array(penalties, dtype=np.float32), device)[:, None]
    sub = logits[row_t]
    scores = sub.gather(1, index_t)
    sub.scatter_(1, index_t, torch.where(scores < 0, scores * penalty, scores / penalty))
    logits[row_t] = sub


def apply_output_penalties(logits: torch.Tensor, rows: list[int], output_ids: Seq[Seq[int]],
                           frequency: list[float], presence: list[float]) -> None:
    """As OpenAI (and vLLM): each row's logits minus frequency x the token's count in its output so far,
    minus presence where that count is above 0. Counts for all rows in one scatter-add."""
    vocab = logits.shape[1]
    width = max((len(ids) for ids in output_ids), default=0)
    if width == 0:
        return
    index = np.full((len(rows), width), vocab, dtype=np.int64)  # padding counts into a column dropped below
    for r, ids in enumerate(output_ids):
        index[r, :len(ids)] = ids
    device = logits.device
    index_t = to_device(index, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(
        1, index_t, torch.ones(index_t.shape, device=device))[:, :vocab]
    penalties = to_device(np.array([frequency, presence], dtype=np.float32).T.copy(), device)
    row_t = to_device(np.array(rows, dtype=np.int64), device)
    logits[row_t] -= penalties[:, 0:1] * counts + penalties[:, 1:2] * (counts > 0)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p filters, then one draw per row from its generator.
    logits [rows, vocab] float32 (not modified); returns the drawn token ids [rows] (int64, on the device)."""
    rows, vocab = logits.shape
    device = logits.device
    settings = np.array([[p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.min_p, p.top_p]
                         for p in params], dtype=np.float32)
    knobs = to_device(settings, device)
    x = logits / knobs[:, 0:1]
    if any(0 < p.top_k < vocab for p in params):
        k = max(int(v) for v in settings[:, 1])
        top = torch.topk(x, k, dim=-1).values  # [rows, k], descending
        kth = top.gather(1, (knobs[:, 1:2].long() - 1).clamp(max=k - 1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < knobs[:, 2:3] * probs.amax(dim=-1, keepdim=True), 0.0)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        drop = cumulative - sorted_probs > knobs[:, 3:4] * cumulative[:, -1:]
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    noise = torch.empty_like(probs)
    for r, generator in enumerate(generators):
        noise[r].exponential_(generator=generator)
    return (probs / noise.clamp_(min=1e-30)).argmax(dim=-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row's draw (sample_rows for a single row)."""
    return int(sample_rows(logits[None], [params], [generator])[0])


def _logprobs(raw: torch.Tensor, rows: list[int], tokens: list[int], tops: list[int]) -> list[dict[str, Any]]:
    """The chosen tokens' log-probabilities under the raw logits, and each row's top alternatives."""
    index = to_device(np.array(rows, dtype=np.int64), raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)
    chosen = to_device(np.array([max(tokens[i], 0) for i in rows], dtype=np.int64), raw.device)
    top = max(tops)
    values = [logprobs.gather(1, chosen[:, None])[:, 0]]
    if top:
        top_values, top_ids = logprobs.topk(top, dim=-1)
        values += [top_values.flatten(), top_ids.flatten().to(logprobs.dtype)]
    flat = torch.cat(values).tolist()  # one read (float32 holds vocabulary ids exactly)
    n = len(rows)
    entries = []
    for r, i in enumerate(rows):
        entry: dict[str, Any] = {"token": max(tokens[i], 0), "logprob": flat[r]}
        if tops[r]:
            start = n + r * top
            ids = flat[n + n * top + r * top:n + n * top + r * top + tops[r]]
            entry["top"] = [[int(t), v] for t, v in zip(ids, flat[start:start + tops[r]], strict=True)]
        entries.append(entry)
    return entries

"""Sampling as small pure functions over a step's logits [num_sampled, vocab] (float32), batched on the
logits' device: masks, penalties, temperature and the top-k / top-p / min-p filters act on all rows at once,
and the step reads back one tensor (the chosen tokens, or a code where a row cannot be sampled). That read
is the step's only synchronisation with a GPU; log-probabilities, where asked for, come back beside it.

A row is broken when its logits hold NaN or +inf (a NaN wins the row's max and argmax, so the chosen or the
largest logit tells); -inf is what masks write (a grammar, ignore_eos), never a fault. A row whose every token
is masked has nothing to sample: its grammar reached a dead end.

Drawn rows follow transformers' warpers (temperature, then top-k, top-p, min-p) exactly, without sorting the
vocabulary: the filters act on the row's best CANDIDATES logits (one top-k; on a CPU, our C kernel's one
pass that also gives top-p its normaliser), and a row goes to the full-vocabulary path only where that
cut cannot decide its kept set (no filter at all, or a set wider than the cut). Each row draws its
exponential noise from its own torch.Generator, seeded from its request's seed, and the token is the
winner of the exponential race, argmax(weight / noise) over its kept candidates (an exact draw); over the
whole vocabulary the race runs in two levels, blocks of BLOCK tokens first (a block's best time is
exponential with the block's mass), then the tokens of the winning block. A sampled request gives the same
tokens whatever else shares its batch: a race flips only on a near-tie, so the rounding by which a batch
moves the logits changes a draw as rarely as it flips a greedy near-tie (an inverse CDF, tried first,
moved its boundaries across whole runs of tail tokens and changed one token in a thousand).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from bulkgen.config import SamplingParams
from bulkgen.engine.draws import CANDIDATES, WIDE_CUT, Candidates, sample_rows, to_device
from bulkgen.engine.sequence import Sequence

__all__ = ["CANDIDATES", "WIDE_CUT", "sample", "sample_row", "sample_rows", "to_device"]

NOT_FINITE = -1  # read back for a row whose logits held NaN or +inf
NO_TOKEN = -2  # read back for a row whose every token was masked
BROKEN = "the model produced non-finite logits (NaN or +inf) for this request"
DEAD_END = ("the JSON schema allows no next token here (its grammar reached a dead end): check that the schema "
            "can be completed")


@dataclass
class SampleResult:
    token_ids: list[int]
    errors: list[str | None]  # per row: None, or why that row could not be sampled (that sequence fails)
    logprobs: list[Any]  # per row: None, or {"token": id, "logprob": x, "top": [[id, logprob], ...]}


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int],
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
           candidates: Candidates | None = None,
           generators: list[torch.Generator | None] | None = None) -> SampleResult:
    """Choose each row's next token. `logits` may be modified in place (masks, penalties) unless a row
    needs them raw (log-probabilities). `argmax` is row-wise over float32 (torch's by default);
    `candidates` the C kernels' pass of sampled rows over the vocabulary (cpu/ops.Ops; None: torch's);
    `generators`: each row's, seeded for its draw (the engine's: Sequence.draw_seed; None: each sampled row's
    from its request's seed)."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        return SampleResult([], [], [])
    device = logits.device
    needs_raw = any(s.params.logprobs is not None for s in seqs)
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
    if generators is None:
        generators = [None if s.params.is_greedy else torch.Generator(device=device).manual_seed(s.params.seed or 0)
                      for s in seqs]
    tokens, best = _choose(processed, seqs, generators, argmax or (lambda x: x.argmax(dim=-1)), candidates)
    codes = torch.where(torch.isnan(best) | (best == float("inf")), NOT_FINITE,
                        torch.where(best == float("-inf"), NO_TOKEN, tokens))
    chosen = codes.tolist()  # the step's one read
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    logprobs: list[Any] = [None] * num_rows
    if wanted:
        for i, entry in zip(wanted, _logprobs(logits, wanted, chosen, [seqs[i].params.logprobs for i in wanted]),
                            strict=True):
            logprobs[i] = entry
    errors = [None if t >= 0 else DEAD_END if t == NO_TOKEN and seq.matcher is not None else BROKEN
              for t, seq in zip(chosen, seqs, strict=True)]
    return SampleResult([max(t, 0) for t in chosen], errors, logprobs)


def _choose(processed: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator | None],
            argmax: Callable[[torch.Tensor], torch.Tensor],
            candidates: Candidates | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token [rows] (int64) and its largest processed logit [rows] (NaN if the row holds one)."""
    device = processed.device
    drawn = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
    if not drawn:  # a NaN or +inf logit wins argmax: the chosen logit tells a broken row
        tokens = argmax(processed).to(device)
        return tokens, processed.gather(1, tokens[:, None])[:, 0]
    if len(drawn) == len(seqs):
        return sample_rows(processed, [s.params for s in seqs], generators, True, candidates)
    greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    tokens = torch.empty(len(seqs), dtype=torch.int64, device=device)
    best = torch.empty(len(seqs), dtype=processed.dtype, device=device)
    for rows, (row_tokens, row_best) in (
            (greedy, _choose(processed[to_device(np.array(greedy), device)], [seqs[i] for i in greedy],
                             [None] * len(greedy), argmax)),
            (drawn, sample_rows(processed[to_device(np.array(drawn), device)], [seqs[i].params for i in drawn],
                                [generators[i] for i in drawn], True, candidates))):
        index = to_device(np.array(rows, dtype=np.int64), device)
        tokens[index], best[index] = row_tokens, row_best
    return tokens, best


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

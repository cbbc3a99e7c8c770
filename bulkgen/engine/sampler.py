"""Sampling as small pure functions over a step's logits [num_sampled, vocab] (float32), batched on the
logits' device: masks, penalties, temperature and the top-k / top-p / min-p filters act on all rows at once,
and the step reads back one tensor (the chosen tokens, or a code where a row cannot be sampled). That read
is the step's only synchronisation with a GPU; log-probabilities, where asked for, come back beside it.

A row is broken when its logits hold NaN or +inf (a NaN wins the row's max and argmax, so the chosen or the
largest logit tells); -inf is what masks write (a grammar, ignore_eos), never a fault. A row whose every token
is masked has nothing to sample: its grammar reached a dead end.

Drawn rows follow transformers' warpers (temperature, then top-k, top-p, min-p) exactly, without sorting the
vocabulary: the filters act on the row's best CANDIDATES logits (one top-k), and a row goes to the full-vocabulary
path only where that cut cannot decide its kept set (no filter at all, or a set wider than the cut). Each row
draws its exponential noise from its own torch.Generator, seeded from its request's seed, and the token is the
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
from bulkgen.engine.sequence import Sequence

NOT_FINITE = -1  # read back for a row whose logits held NaN or +inf
NO_TOKEN = -2  # read back for a row whose every token was masked
# The cut the filters act on first. A topk of 256 over SmolLM2's 49,152 logits costs about a tenth of the
# sort it replaces; 256 holds the nucleus (top-p 0.95, T 0.8) of almost every real step.
CANDIDATES = 256

WIDE_CUT = 4096  # the full-vocabulary path's second cut for top-p, before a sort of the whole row
BLOCK = 1024  # the full-vocabulary path's race: blocks first, then the tokens of one block
BROKEN = "the model produced non-finite logits (NaN or +inf) for this request"
DEAD_END = ("the JSON schema allows no next token here (its grammar reached a dead end): check that the schema "
            "can be completed")


@dataclass
class SampleResult:
    token_ids: list[int]
    errors: list[str | None]  # per row: None, or why that row could not be sampled (that sequence fails)
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
    needs them raw (log-probabilities). `argmax` is row-wise over float32 (torch's by default)."""
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
    tokens, best = _choose(processed, seqs, argmax or (lambda x: x.argmax(dim=-1)))
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


def _choose(processed: torch.Tensor, seqs: list[Sequence],
            argmax: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token [rows] (int64) and its largest processed logit [rows] (NaN if the row holds one)."""
    device = processed.device
    drawn = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
    if not drawn:  # a NaN or +inf logit wins argmax: the chosen logit tells a broken row
        tokens = argmax(processed).to(device)
        return tokens, processed.gather(1, tokens[:, None])[:, 0]
    if len(drawn) == len(seqs):
        return sample_rows(processed, [s.params for s in seqs], [s.generator for s in seqs], with_best=True)
    greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    tokens = torch.empty(len(seqs), dtype=torch.int64, device=device)
    best = torch.empty(len(seqs), dtype=processed.dtype, device=device)
    for rows, (row_tokens, row_best) in (
            (greedy, _choose(processed[to_device(np.array(greedy), device)], [seqs[i] for i in greedy], argmax)),
            (drawn, sample_rows(processed[to_device(np.array(drawn), device)], [seqs[i].params for i in drawn],
                                [seqs[i].generator for i in drawn], with_best=True))):
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


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                with_best: bool = False) -> Any:
    """Temperature, then top-k, top-p and min-p as transformers' warpers apply them, then one draw per row
    from its generator. logits [rows, vocab] float32 (not modified); returns the drawn token ids [rows] (int64,
    on the device), and with_best also each row's largest logit [rows]."""
    rows, vocab = logits.shape
    device = logits.device
    cut = min(CANDIDATES, vocab)
    settings = np.array([[p.temperature, p.top_k if 0 < p.top_k < vocab else 0, p.min_p, p.top_p]
                         for p in params], dtype=np.float32)
    knobs = to_device(settings, device)
    temperature, top_k, min_p, top_p = (knobs[:, i:i + 1] for i in range(4))  # each [rows, 1]
    num_blocks = -(-vocab // BLOCK)
    # each row's noise, one call to its generator: the cut's candidates, then the blocks, then one block
    noise = torch.stack([torch.empty(cut + num_blocks + BLOCK, device=device).exponential_(generator=g)
                         for g in generators]).clamp_(min=1e-30)  # [rows, cut + num_blocks + BLOCK]
    best = logits.amax(dim=-1)  # NaN where a row holds one
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    # rows with no filter keep the whole vocabulary: no cut can decide them
    is_open = (settings[:, 1] == 0) & (settings[:, 2] == 0) & (settings[:, 3] >= 1.0)
    wide = np.flatnonzero(is_open)
    if not is_open.all():
        cut_rows = np.flatnonzero(~is_open)
        index = None if len(cut_rows) == rows else to_device(cut_rows, device)
        sub = logits if index is None else logits[index]
        values, ids = sub.topk(cut, dim=-1)  # [n, cut], descending: the same order as logits / T
        values, ids = _ties_by_id(values, ids)
        knobs_cut = [k if index is None else k[index] for k in (temperature, top_k, min_p, top_p, noise[:, :cut])]
        # top-p without top-k is relative to the whole row's mass: one pass for its normaliser (an upper
        # bound from the cut alone was too loose to decide three rows in four of SmolLM2's)
        z_rows = settings[cut_rows][:, 3] < 1.0
        log_z = None
        if z_rows.any():  # sum of exp((logits - best) / T): one fused multiply-add, exp in place, a sum
            inverse_t = 1.0 / knobs_cut[0]
            log_z = torch.addcmul(-values[:, :1] * inverse_t, sub, inverse_t).exp_().sum(dim=-1, keepdim=True).log_()
        picked, decided = _sample_candidates(values, ids, *knobs_cut, vocab, log_z)
        if index is None:
            tokens = picked
        else:
            tokens[index] = picked
        if cut < vocab:
            undecided = decided.logical_not().cpu().numpy()  # a read, on a step that samples
            wide = np.union1d(wide, cut_rows[undecided])
    if len(wide):
        index = None if len(wide) == rows else to_device(wide, device)
        knob = (lambda t: t) if index is None else (lambda t: t[index])
        picked = _sample_full(logits if index is None else logits[index], knob(temperature), knob(top_k),
                              knob(min_p), knob(top_p), knob(noise[:, cut:]), knob(best[:, None]), settings[wide])
        if index is None:
            tokens = picked
        else:
            tokens[index] = picked
    return (tokens, best) if with_best else tokens


def _ties_by_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in one order whatever the batch: by value, equal values by token id."""
    by_id, order = ids.sort(dim=-1)
    values = values.gather(1, order)
    by_value, order = values.sort(dim=-1, descending=True, stable=True)
    return by_value, by_id.gather(1, order)


def _sample_candidates(values: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       min_p: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor, vocab: int,
                       log_z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws among each row's candidates ([rows, cut], descending), and whether the cut decided the row: its
    kept set lies inside the cut (a filter drops the last candidate, hence all beyond it), and top-p's
    normaliser is known (log_z: the row's, relative to its best; or the top-k set's inside the cut) or
    bounded tightly enough that no candidate's fate depends on it (the rest of the set is at most
    (set size - cut) x the last candidate's weight)."""
    rows, cut = values.shape
    x = (values - values[:, :1]) / temperature  # log-weights against the best candidate (x[:, 0] = 0)
    has_k = top_k > 0
    kth = values.gather(1, (top_k.long() - 1).clamp(0, cut - 1))
    k_within = has_k & (top_k <= cut)
    k_decided = k_within & ((kth > values[:, -1:]) | (cut == vocab))
    keep = ~k_within | (values >= kth)
    weights = torch.exp(x) * keep
    # top-p over the top-k set's mass where the cut holds it, else bounded by what lies beyond the cut
    z_low = weights.sum(dim=-1, keepdim=True)
    set_size = torch.where(has_k, top_k, torch.full_like(top_k, vocab))
    z_high = torch.where(k_decided, z_low, z_low + (set_size - cut).clamp(min=0) * torch.exp(x[:, -1:]))
    if log_z is not None:  # the whole row's mass, where top-k does not narrow it
        exact = torch.exp(log_z)
        z_low, z_high = (torch.where(has_k, z, exact) for z in (z_low, z_high))
    before = weights.cumsum(dim=-1) - weights  # mass of the better candidates
    p_kept = before < top_p * z_low  # kept whatever the normaliser
    p_dropped = before >= top_p * z_high  # dropped whatever the normaliser
    has_p = top_p < 1.0
    keep_m = (x >= torch.log(min_p.clamp(min=1e-30))) | (min_p <= 0)
    undecided_p = has_p & ~p_kept & ~p_dropped & keep & keep_m
    keep = keep & keep_m & (p_kept | ~has_p)
    drops_last = (k_decided | (has_p & p_dropped[:, -1:]) | ((min_p > 0) & ~keep_m[:, -1:])
                  | (cut == vocab))
    decided = (drops_last & ~undecided_p.any(dim=-1, keepdim=True) & ~(k_within & ~k_decided))[:, 0]
    # the race in token order: each candidate's noise is the same whatever its rank, so near-equal logits
    # that a batch's rounding swaps do not swap their draws
    by_id = ids.argsort(dim=-1)
    pick = ((weights * keep).gather(1, by_id) / noise).argmax(dim=-1, keepdim=True)
    return ids.gather(1, by_id.gather(1, pick))[:, 0], decided


def _sample_full(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor,
                 top_p: torch.Tensor, noise: torch.Tensor, best: torch.Tensor, settings: np.ndarray) -> torch.Tensor:
    """Rows over the whole vocabulary: weights relative to the best token (in place, three passes), filters,
    then the race in two levels (blocks of BLOCK tokens, then the tokens of the winning block), so that no
    row draws noise for its whole vocabulary."""
    rows, vocab = logits.shape
    weights = logits.sub(best).div_(temperature).exp_()  # p / p_max
    if (settings[:, 1] > 0).any():
        k = int(settings[:, 1].max())
        kth = torch.topk(weights, k, dim=-1).values.gather(1, (top_k.long() - 1).clamp(min=0))
        weights.masked_fill_((weights < kth) & (top_k > 0), 0.0)
    if (settings[:, 3] < 1.0).any():
        weights = _nucleus(weights, top_p)
    if (settings[:, 2] > 0).any():
        weights.masked_fill_(weights < min_p, 0.0)
    num_blocks = -(-vocab // BLOCK)
    if vocab % BLOCK:
        weights = torch.nn.functional.pad(weights, (0, num_blocks * BLOCK - vocab))
    blocks = weights.view(rows, num_blocks, BLOCK)
    # a block's fastest token finishes at an exponential time of the block's mass: race the blocks, then
    # the winning block's tokens (noise: [rows, num_blocks + BLOCK])
    block = (blocks.sum(dim=-1) / noise[:, :num_blocks]).argmax(dim=-1, keepdim=True)  # [rows, 1]
    inside = blocks.gather(1, block[:, :, None].expand(rows, 1, BLOCK))[:, 0]  # [rows, BLOCK]
    offset = (inside / noise[:, num_blocks:num_blocks + BLOCK]).argmax(dim=-1, keepdim=True)
    return (block * BLOCK + offset).clamp_(max=vocab - 1)[:, 0]


def _nucleus(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over whole rows of weights, as transformers does (a token is kept while the mass of the better
    ones is below top_p): decided within the best WIDE_CUT where that holds the nucleus (the whole mass is
    known here), sorted whole only where it does not (a sort of SmolLM2's row cost ~2 ms)."""
    rows, vocab = weights.shape
    total = weights.sum(dim=-1, keepdim=True)
    wide = min(WIDE_CUT, vocab)
    best, order = weights.topk(wide, dim=-1)
    best, order = _ties_by_id(best, order)
    drop = best.cumsum(dim=-1) - best >= top_p * total
    drop &= top_p < 1.0
    kept = torch.zeros_like(weights).scatter_(1, order, best.masked_fill(drop, 0.0))
    # rows whose nucleus reaches past the wide cut (or that have no top-p) keep their own weights here
    whole = ~drop[:, -1] if wide < vocab else torch.zeros(rows, dtype=torch.bool, device=weights.device)
    whole_rows = whole.nonzero()[:, 0].tolist()
    for r in whole_rows:
        if float(top_p[r]) >= 1.0:
            kept[r] = weights[r]
            continue
        sorted_w, row_order = weights[r].sort(descending=True, stable=True)
        row_drop = sorted_w.cumsum(dim=-1) - sorted_w >= top_p[r] * total[r]
        kept[r] = torch.zeros_like(weights[r]).scatter_(0, row_order, sorted_w.masked_fill(row_drop, 0.0))
    return kept


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

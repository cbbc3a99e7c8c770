"""Drawing a step's sampled rows from their filtered distributions, exactly as transformers' warpers define
them (temperature, then top-k, top-p, min-p), without sorting the vocabulary (sampler.py's module note
says how). Pure functions over logits [rows, vocab] float32 on their device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bulkgen.config import SamplingParams

# The cut the filters act on first. A topk of 256 over SmolLM2's 49,152 logits costs about a tenth of the
# sort it replaces; 256 holds the nucleus (top-p 0.95, T 0.8) of almost every real step.
CANDIDATES = 256

# cpu/ops.Ops.candidates: (logits, rows or None, 1 / T [n, 1], want_z [n], cut) -> (values, ids, best, log_z,
# order by id) or None
Candidates = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, int], tuple | None]

WIDE_CUT = 4096  # the full-vocabulary path's second cut for top-p, before a sort of the whole row
BLOCK = 1024  # the full-vocabulary path's race: blocks first, then the tokens of one block


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting for the GPU: from pinned memory, asynchronously."""
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                with_best: bool = False, candidates: Candidates | None = None) -> Any:
    """Temperature, then top-k, top-p and min-p as transformers' warpers apply them, then one draw per row
    from its generator. logits [rows, vocab] float32 (not modified); returns the drawn token ids [rows] (int64,
    on the device), and with_best also each row's largest logit [rows]. `candidates`: the C kernel's pass
    over the vocabulary (cpu/ops.Ops.candidates), or None for torch's."""
    rows, vocab = logits.shape
    device = logits.device
    settings = np.array([[p.temperature, p.top_k if 0 < p.top_k < vocab else 0, p.min_p, p.top_p]
                         for p in params], dtype=np.float32)
    knobs = to_device(settings, device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    best = torch.empty(rows, dtype=logits.dtype, device=device)  # NaN where a row holds one
    # rows with no filter keep the whole vocabulary: no cut can decide them
    is_open = (settings[:, 1] == 0) & (settings[:, 2] == 0) & (settings[:, 3] >= 1.0)
    pending = np.flatnonzero(~is_open)
    for cut in sorted({min(CANDIDATES, vocab), min(WIDE_CUT, vocab)}):  # the cut, then a wider one
        if not len(pending):
            break
        index = None if len(pending) == rows else to_device(pending, device)
        picked, row_best, decided = _cut_stage(logits, index, cut, settings[pending], _rows(knobs, index),
                                               [generators[i] for i in pending], candidates)
        for out, value in ((tokens, picked), (best, row_best)):
            out.copy_(value) if index is None else out.index_copy_(0, index, value)
        if cut == vocab:
            break
        pending = pending[~decided.cpu().numpy()]  # a read, on a step that samples
    wide = np.union1d(np.flatnonzero(is_open), pending)
    if len(wide):
        index = None if len(wide) == rows else to_device(wide, device)
        sub = _rows(logits, index)
        row_best = sub.amax(dim=-1)
        noise = _noise([generators[i] for i in wide], -(-vocab // BLOCK) + BLOCK, device)
        picked = _sample_full(sub, *_rows(knobs, index).split(1, dim=1), row_best[:, None], noise, settings[wide])
        for out, value in ((tokens, picked), (best, row_best)):
            out.copy_(value) if index is None else out.index_copy_(0, index, value)
    return (tokens, best) if with_best else tokens


def _cut_stage(logits: torch.Tensor, index: torch.Tensor | None, cut: int, settings: np.ndarray,
               knobs: torch.Tensor, generators: list[torch.Generator | None],
               candidates: Candidates | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `index` (None: all) drawn among their best `cut` logits: (tokens, largest logits, decided), where
    decided says which rows the cut held (the others are drawn again, wider)."""
    temperature, top_k, min_p, top_p = knobs.split(1, dim=1)  # each [n, 1]
    # top-p without top-k is relative to the whole row's mass: its normaliser, from one pass (an upper
    # bound from the cut alone was too loose to decide three rows in four of SmolLM2's)
    z_rows = (settings[:, 3] < 1.0) & (settings[:, 1] == 0)
    inverse_t = 1.0 / temperature
    found = None if candidates is None else candidates(
        logits, index, inverse_t, to_device(z_rows.astype(np.int32), logits.device), cut)
    if found is not None:
        values, ids, best, log_z, by_id = found
    else:
        sub = _rows(logits, index)
        values, ids = _ties_by_id(*sub.topk(cut, dim=-1))  # [n, cut], descending: as logits / T
        best, log_z, by_id = values[:, 0], None, None
        if z_rows.any():  # sum of exp((logits - best) / T): one fused multiply-add, exp in place, a sum
            log_z = torch.addcmul(-values[:, :1] * inverse_t, sub, inverse_t).exp_().sum(dim=-1, keepdim=True).log_()
    if not z_rows.any():
        log_z = None
    noise = _noise(generators, cut, logits.device)
    picked, decided = _sample_candidates(values, ids, temperature, top_k, min_p, top_p, noise,
                                         logits.shape[1], log_z, by_id)
    return picked, best, decided


def _noise(generators: list[torch.Generator | None], size: int, device: torch.device) -> torch.Tensor:
    """Exponential noise [rows, size], each row from its own generator: a row draws `size` for its cut's
    candidates, and again for the whole vocabulary only where the cut did not decide it (which depends on
    its logits alone, so a row's stream is the same whatever its batch)."""
    return torch.stack([torch.empty(size, device=device).exponential_(generator=g)
                        for g in generators]).clamp_(min=1e-30)


def _rows(tensor: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """These rows of a step's tensor (None: all of them, no copy)."""
    return tensor if index is None else tensor[index]


def _ties_by_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates in one order whatever the batch: by value, equal values by token id."""
    by_id, order = ids.sort(dim=-1)
    values = values.gather(1, order)
    by_value, order = values.sort(dim=-1, descending=True, stable=True)
    return by_value, by_id.gather(1, order)


def _sample_candidates(values: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       min_p: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor, vocab: int,
                       log_z: torch.Tensor | None = None,
                       by_id: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws among each row's candidates ([rows, cut], descending), and whether the cut decided the row: its
    kept set lies inside the cut (a filter drops the last candidate, hence all beyond it), and top-p's
    normaliser is known (log_z: the row's, relative to its best; or the top-k set's inside the cut) or
    bounded tightly enough that no candidate's fate depends on it (the rest of the set is at most
    (set size - cut) x the last candidate's weight). by_id: the candidates' order by token id, if known."""
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
    by_id = ids.argsort(dim=-1) if by_id is None else by_id
    pick = ((weights * keep).gather(1, by_id) / noise).argmax(dim=-1, keepdim=True)
    return ids.gather(1, by_id.gather(1, pick))[:, 0], decided


def _sample_full(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor,
                 top_p: torch.Tensor, best: torch.Tensor, noise: torch.Tensor, settings: np.ndarray) -> torch.Tensor:
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

"""A step's types, the leaf that every attention path reads (engine/attention.py, cpu/, gpu/): what each layer's
attention computes (LayerAttention), a prefill chunk, and a step's metadata for the backend that runs it: C or torch
(CpuMetadata) or Triton (TritonMetadata). Nothing of the engine's core is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # a type only: the kernels' library is loaded by paths.py
    from bulkgen.engine.cpu.kernels import Kernels

ATTENTION_NAME = "bulkgen_paged"  # bulkgen's attention in transformers' attention (and mask) interfaces


def k_block_shape(num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                  transposed: bool = True) -> tuple[int, ...]:
    """One block of K. For the CPU kernels, transposed: [num_kv_heads, head_dim / P, block_size, P] (dims
    outer, rows inner) so that decode attention scores 16 rows per vector; P = 2 for 2-byte types
    (bfloat16: dims in pairs, the operand of AVX512-BF16's dot-product instruction), else 1. For the Triton
    kernels, as V: [num_kv_heads, block_size, head_dim]."""
    if not transposed:
        return (num_kv_heads, block_size, head_dim)
    pair = 2 if torch.empty((), dtype=dtype).element_size() == 2 and head_dim % 2 == 0 else 1
    return (num_kv_heads, head_dim // pair, block_size, pair)


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention computes besides softmax(q·k * scale)·v over the causal context.
    window > 0: key k is seen from query q only where q - window < k <= q (Hugging Face's sliding-window
    masks); softcap > 0: each score becomes softcap * tanh(score / softcap) (Gemma 2); sinks [num_heads]:
    a logit per head that joins the softmax with no value (gpt-oss)."""

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Whether torch's fused SDPA computes it (no softcap, no sinks)."""
        return self.softcap == 0.0 and self.sinks is None

    def c_sinks(self) -> int | None:
        """The sinks for the C kernels: a float32 [num_heads] pointer (None: no sinks)."""
        return None if self.sinks is None else self.sinks.data_ptr()


FULL = LayerAttention()


def causal_mask(start: int, num_tokens: int, window: int, device: torch.device) -> torch.Tensor:
    """[num_tokens, start + num_tokens] bool: what query rows at positions start.. see of the sequence."""
    q = torch.arange(start, start + num_tokens, device=device)[:, None]
    k = torch.arange(start + num_tokens, device=device)[None, :]
    mask = k <= q
    return mask & (k > q - window) if window else mask


@dataclass
class PrefillChunk:
    offset: int  # first token of the chunk in the flattened batch
    num_tokens: int
    start: int  # position of its first token in the sequence (0 unless part is cached)
    context_blocks: torch.Tensor | None = None  # [start + num_tokens] block of each position, when start > 0
    context_offsets: torch.Tensor | None = None  # [start + num_tokens] row within the block
    mask: torch.Tensor | None = None  # [num_tokens, start + num_tokens] bool, when start > num_tokens
    block_table: torch.Tensor | None = None  # [num_blocks] int32: the sequence's blocks (for the C kernel)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # causal_mask by window, built once a step

    def mask_for(self, window: int, device: torch.device) -> torch.Tensor:
        if window not in self.windowed:
            self.windowed[window] = causal_mask(self.start, self.num_tokens, window, device)
        return self.windowed[window]


@dataclass(frozen=True)
class MaskSpan:
    """What a layer's own mask lets a query see, as the model's code builds it (read by probe.mask_span while the
    runner probes the model): the last `window` positions up to its own (0: all of them)."""

    window: int


@dataclass
class ProbeRecord:
    """What the probe's step records (probe.py): the layers whose attention came through bulkgen's, in call order,
    and the window each one's own mask gave."""

    calls: list[int] = field(default_factory=list)
    windows: dict[int, int] = field(default_factory=dict)


@dataclass(kw_only=True)
class AttentionMetadata:
    """What every layer's attention needs for one step, on any backend (built once a step by the runner's backend)."""

    k_caches: list[torch.Tensor]  # per layer: [num_blocks, *k_block_shape(...)]
    v_caches: list[torch.Tensor]  # per layer: [num_blocks, num_kv_heads, block_size, head_dim]
    windows: tuple[int, ...] = ()  # per layer: its sliding window (0, or none given: the whole context)
    probe: ProbeRecord | None = None  # set on the probe's step at load
    # Where layers hold their K/V in groups (block_manager.KVLayout): each group's metadata, and each layer's group;
    # a layer's attention reads its own group's
    groups: list[AttentionMetadata] | None = None
    layer_groups: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_groups[layer]] if self.layer_groups else self


@dataclass(kw_only=True)
class CpuMetadata(AttentionMetadata):
    """A step for the C kernels and torch (engine/attention.attend, cpu/attention.py)."""

    slots: torch.Tensor  # [num_tokens] int64: block * block_size + row of each new token's K/V
    slot_blocks: torch.Tensor  # [num_tokens] int64: the block of each new token's K/V
    slot_offsets: torch.Tensor  # [num_tokens] int64: its row within the block
    num_decode_tokens: int  # the first tokens of the batch, one per decoding sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] (int32 for the kernel)
    decode_context_lens: torch.Tensor  # [num_decodes] int32, tokens to attend to (the new one included)
    decode_max_context_len: int
    # the decoding sequences in work items that share their first blocks (cpu/attention.shared_items: order,
    # starts, shared tokens), for the C decode kernel; None where no two share a block
    decode_shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The C kernels for decode attention, prefill attention and the KV write (None: torch); each family's
    # path is chosen per machine (paths.py)
    decode_kernel: Kernels | None = None
    prefill_kernel: Kernels | None = None
    write_kernel: Kernels | None = None
    num_threads: int = 1


@dataclass(kw_only=True)
class TritonMetadata(AttentionMetadata):
    """A step for the Triton kernels (gpu/attention.py): int32 tensors on the device (gpu/step.py: one copy from
    the host; gpu/graphs.py: a captured graph's buffer)."""

    slots: torch.Tensor  # [num_tokens]
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # [num_decodes]
    decode_splits: int  # splits of each decoding sequence's blocks (flash-decoding)
    decode_params: torch.Tensor  # [2] the tables' row stride, blocks a split (gpu/attention.decode_params)
    tile_chunks: torch.Tensor  # [num_tiles] the prefill chunk of each tile of query rows
    tile_rows: torch.Tensor  # [num_tiles] its first row within the chunk
    chunk_offsets: torch.Tensor  # [num_chunks] first token of each chunk in the flattened batch
    chunk_lens: torch.Tensor  # [num_chunks]
    chunk_starts: torch.Tensor  # [num_chunks] tokens of its sequence cached before it
    chunk_block_tables: torch.Tensor  # [num_chunks, max_blocks]


@dataclass
class ChunkInput:
    """A prefill chunk as the step's inputs give it to a backend (which builds its own PrefillChunk or tables)."""

    offset: int  # first token of the chunk in the flattened batch
    num_tokens: int
    start: int  # tokens of its sequence computed before it
    table: list[int]  # its sequence's blocks in this group
    context_slots: np.ndarray  # [start + num_tokens] the cache slot of each position up to its last


@dataclass
class StepInputs:
    """A step's scheduled tokens flattened into one ragged batch (decode rows first, then prefill chunks): the ids and
    positions of its new tokens, the rows that are sampled and their sequences. scheduled: the scheduler's
    ScheduledSeq (a sequence and its new tokens this step). A sequence with one token of its own and a draft after
    it (speculate.py) is a decode row a token: each row attends up to its own position (the step writes every new
    token's K/V before attention reads any), so a draft costs rows of the batched decode kernel, not a chunk."""

    decodes: list  # (sequence, position) of each decode row
    prefills: list  # ScheduledSeq with several new tokens (a prompt's chunk)
    input_ids: list[int]
    positions: list[int]
    sample_rows: list[int]  # rows whose sequences reach their known tokens this step (and their drafts' rows)
    sampled: list  # their sequences (a drafted one once a row)

    @classmethod
    def of(cls, scheduled: list) -> StepInputs:
        rows = [s for s in scheduled if s.num_new_tokens - s.num_draft_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens - s.num_draft_tokens > 1]
        inputs = cls([], prefills, [], [], [], [])
        for s in rows:
            seq, start = s.seq, s.seq.num_computed_tokens
            inputs.input_ids.append(seq.token_ids[start])
            inputs.input_ids.extend(seq.draft[:s.num_draft_tokens])
            for position in range(start, start + s.num_new_tokens):
                inputs.decodes.append((seq, position))
                inputs.positions.append(position)
        for s in prefills:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            inputs.input_ids.extend(s.seq.token_ids[start:start + n])
            inputs.positions.extend(range(start, start + n))
        offset = 0
        for s in rows + prefills:
            offset += s.num_new_tokens
            sampled = s.num_sampled  # a drafted sequence's rows follow one another, one a position
            inputs.sample_rows.extend(range(offset - sampled, offset))
            inputs.sampled.extend([s.seq] * sampled)
        return inputs

    def decode_tables(self, group: int) -> list[list[int]]:
        return [seq.block_tables[group] for seq, _ in self.decodes]

    def decode_context_lens(self) -> list[int]:
        """Tokens each decode row attends to, its own included."""
        return [position + 1 for _, position in self.decodes]

    def group_slots(self, group: int, block_size: int) -> tuple[list[int], list[ChunkInput]]:
        """The cache slots of the step's new tokens in one group's blocks, and its prefill chunks."""
        bs = block_size
        slots: list[int] = []
        for seq, pos in self.decodes:
            slots.append(seq.block_tables[group][pos // bs] * bs + pos % bs)
        chunks: list[ChunkInput] = []
        offset = len(self.decodes)
        for s in self.prefills:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            table = s.seq.block_tables[group]
            context_slots = slots_of(table, bs, 0, start + n)  # the chunk's and its context's
            slots.extend(context_slots[start:].tolist())
            chunks.append(ChunkInput(offset, n, start, table, context_slots))
            offset += n
        return slots, chunks


def slots_of(block_table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots of positions [start, end): block_table[p // block_size] * block_size + p % block_size.

        positions   0 1 2 3 | 4 5 6 7 | 8 9        (block_size 4)
        block_table [  7    ,    2    ,  5 ]
        slots       28 .. 31| 8 .. 11 | 20 21
    """
    positions = np.arange(start, end)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size

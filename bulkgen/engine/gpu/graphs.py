"""Decode steps replayed as CUDA graphs: a pure-decode step's hundreds of small launches become one.

A graph is captured per bucket of batch sizes (1, 2, 4, 8, ... up to --max-num-seqs), lazily the first time
a step of that size runs, over static buffers: one int32 device buffer holds the step's input ids, positions,
cache slots, block tables (as wide as the longest sequence allowed) and context lengths; a replay fills its
pinned host twin, copies it in one transfer, and replays. A step smaller than its bucket pads the rest with
rows that decode token 0 at position 0 into a scratch block of the cache that no sequence owns, so they read
and write nothing real. Prefill and mixed steps, and decode steps larger than the largest bucket, run eagerly.

Without a GPU (tests, in Triton's interpreter) the same static buffers and padding run eagerly instead of
being captured: everything but the capture itself is checked against Hugging Face's generate().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulkgen.engine.attention import AttentionMetadata, TritonStep
from bulkgen.engine.gpu import attention as triton_attention


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two below max_num_seqs, then max_num_seqs itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class _Graph:
    size: int
    meta: AttentionMetadata
    run: Callable[[], torch.Tensor]  # replays (or, without a GPU, runs) the step; returns logits [size, vocab]


class DecodeGraphs:
    """forward(input_ids, positions, keep, meta) captured per bucket; `run` takes a decode step's rows."""

    def __init__(self, forward: Callable[..., torch.Tensor], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], scratch_block: int, block_size: int, max_blocks_per_seq: int,
                 max_num_seqs: int, num_kv_heads: int, device: torch.device, windows: tuple[int, ...] = ()) -> None:
        self.forward = forward
        self.windows = windows  # each layer's sliding window (AttentionMetadata.windows)
        self.k_caches, self.v_caches = k_caches, v_caches
        self.scratch_block, self.block_size = scratch_block, block_size
        self.width = max_blocks_per_seq
        self.sizes = buckets(max_num_seqs)
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.capture = device.type == "cuda"
        largest = self.sizes[-1]
        # [ids | positions | slots | context lens | tables], each a column block of `largest` rows
        self._sizes = [largest, largest, largest, largest, largest * self.width]
        total = sum(self._sizes)
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=self.capture)
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        self._host_parts = [p.numpy() for p in torch.split(self.host, self._sizes)]
        self._parts = torch.split(self.buffer, self._sizes)
        self.keep = torch.arange(largest, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[int, _Graph] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs decodes, or None (the step runs eagerly)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """A decode step of len(input_ids) sequences -> float32 logits [num_seqs, vocab]."""
        n = len(input_ids)
        size = self.bucket(n)
        assert size is not None, "more decodes than the largest bucket run eagerly"
        self._fill(input_ids, positions, slots, tables, context_lens, size)
        self.buffer.copy_(self.host, non_blocking=True)
        graph = self.graphs.get(size) or self._make(size)
        return graph.run()[:n].float()

    def _fill(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
              context_lens: list[int], size: int) -> None:
        ids, pos, slot, lens, table = self._host_parts
        n = len(input_ids)
        ids[:n], pos[:n], slot[:n], lens[:n] = input_ids, positions, slots, context_lens
        rows = table[:size * self.width].reshape(size, self.width)
        for i, blocks in enumerate(tables):
            rows[i, :len(blocks)] = blocks
        # padding rows: token 0 at position 0, written to and read from the scratch block only
        ids[n:size], pos[n:size], lens[n:size] = 0, 0, 1
        slot[n:size] = self.scratch_block * self.block_size
        rows[n:size, 0] = self.scratch_block

    def _make(self, size: int) -> _Graph:
        ids, pos, slots, lens, tables = self._parts
        empty = self.buffer[:0]
        step = TritonStep(
            slots=slots[:size], decode_block_tables=tables[:size * self.width].view(size, self.width),
            decode_context_lens=lens[:size],
            # fixed per graph, for the longest context allowed: splits past a sequence's blocks are empty
            decode_splits=triton_attention.decode_splits(size, self.num_kv_heads, self.width,
                                                         256 if self.capture else 2 * size * self.num_kv_heads),
            tile_chunks=empty, tile_rows=empty, chunk_offsets=empty, chunk_lens=empty, chunk_starts=empty,
            chunk_block_tables=empty.view(0, 0))
        meta = AttentionMetadata(k_caches=self.k_caches, v_caches=self.v_caches, slots=step.slots,
                                 slot_blocks=step.slots, slot_offsets=step.slots, num_decode_tokens=size,
                                 decode_block_tables=step.decode_block_tables,
                                 decode_context_lens=step.decode_context_lens, decode_max_context_len=0, triton=step,
                                 windows=self.windows)
        keep = self.keep[:size]

        def eager() -> torch.Tensor:
            return self.forward(ids[:size].long(), pos[:size].long(), keep, meta)

        if not self.capture:
            graph = _Graph(size, meta, eager)
        else:
            # Warm up outside the graph (Triton compiles on a first launch; allocator pools settle), then
            # capture. The static host buffer holds this step's rows already: the warm-up computes them, and
            # its writes are the same as the replay's, which follows.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                eager()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, pool=self.pool):
                logits = eager()

            def replay() -> torch.Tensor:
                cuda_graph.replay()
                return logits

            graph = _Graph(size, meta, replay)
        self.graphs[size] = graph
        return graph

"""Decode steps replayed as CUDA graphs: a pure-decode step's hundreds of small launches become one.

A graph is captured per bucket of batch sizes (1, 2, 4, 8, ... up to --max-num-seqs), all of them when the
engine starts (largest first, sharing one memory pool), over static buffers: one int32 device buffer holds the
decode kernel's two ints (gpu/attention.decode_params), the step's input ids, positions, cache slots, context
lengths and, last, its block tables. The tables' rows are as wide as the step's widest table, not the longest
sequence allowed: the kernel reads their stride and its blocks a split from the buffer, so a replay copies one
contiguous prefix of it (the rows of the bucket, the width in use) from its pinned host twin and replays, and
every split of a graph's fixed count takes an even share of the real blocks. A step smaller than its bucket pads
the rest with rows that decode token 0 at position 0 into a scratch block of the cache that no sequence owns, so
they read and write nothing real. Prefill and mixed steps, and decode steps larger than the largest bucket, run
eagerly.

Without a GPU (tests, in Triton's interpreter) the same static buffers and padding run eagerly instead of
being captured: everything but the capture itself is checked against Hugging Face's generate().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulkgen.engine.gpu import attention as triton_attention
from bulkgen.engine.gpu.step import ALIGN
from bulkgen.engine.metadata import TritonMetadata


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
    meta: TritonMetadata
    run: Callable[[], torch.Tensor]  # replays (or, without a GPU, runs) the step; returns logits [size, vocab]


class DecodeGraphs:
    """forward(input_ids, positions, keep, meta) captured per bucket; `run` takes a decode step's rows."""

    def __init__(self, forward: Callable[..., torch.Tensor], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], scratch_block: int, block_size: int, max_blocks_per_seq: int,
                 max_num_seqs: int, num_kv_heads: int, device: torch.device, windows: tuple[int, ...] = ()) -> None:
        self.forward = forward
        self.windows = windows  # each layer's sliding window (metadata.AttentionMetadata.windows)
        self.k_caches, self.v_caches = k_caches, v_caches
        self.scratch_block, self.block_size = scratch_block, block_size
        self.width = max_blocks_per_seq  # the widest table a step may have
        self.sizes = buckets(max_num_seqs)
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.capture = device.type == "cuda"
        rows = -(-self.sizes[-1] // ALIGN) * ALIGN  # each section on 16 bytes, as gpu/step.py's
        # [decode params | ids | positions | slots | context lens | tables], the tables last: a replay copies a prefix
        self._starts = [0, ALIGN, ALIGN + rows, ALIGN + 2 * rows, ALIGN + 3 * rows, ALIGN + 4 * rows]
        total = self._starts[-1] + self.sizes[-1] * self.width
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=self.capture)
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        self._host = self.host.numpy()
        self.keep = torch.arange(self.sizes[-1], dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[int, _Graph] = {}
        self.copied = 0  # int32s the last replay copied to the device

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs decodes, or None (the step runs eagerly)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def splits(self, size: int) -> int:
        """A bucket's split count, fixed in its graph: for its rows over the widest table allowed (a replay's
        blocks a split follow the width in use)."""
        return triton_attention.decode_splits(size, self.num_kv_heads, self.width,
                                              triton_attention.decode_programs(self.device, size, self.num_kv_heads))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every bucket's graph, largest first (the pool's memory is then reused by the smaller ones): at engine
        start, so that no capture, and no kernel compile, falls inside a run."""
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._fill([], [], [], [], [], size)  # padding rows only: the warm-up and capture touch nothing real
                self._copy(size, 1)
                self._make(size)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """A decode step of len(input_ids) sequences -> float32 logits [num_seqs, vocab]."""
        n = len(input_ids)
        size = self.bucket(n)
        assert size is not None, "more decodes than the largest bucket run eagerly"
        width = self._fill(input_ids, positions, slots, tables, context_lens, size)
        self._copy(size, width)
        graph = self.graphs.get(size) or self._make(size)
        return graph.run()[:n].float()

    def _fill(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
              context_lens: list[int], size: int) -> int:
        """The step's rows into the host buffer, padded to its bucket; returns the tables' width."""
        params, ids, pos, slot, lens = (self._host[a:b] for a, b in zip(self._starts, self._starts[1:], strict=False))
        n = len(input_ids)
        width = max((len(blocks) for blocks in tables), default=1)
        params[:2] = triton_attention.decode_params(width, self.splits(size))
        ids[:n], pos[:n], slot[:n], lens[:n] = input_ids, positions, slots, context_lens
        rows = self._host[self._starts[-1]:self._starts[-1] + size * width].reshape(size, width)
        for i, blocks in enumerate(tables):
            rows[i, :len(blocks)] = blocks
        # padding rows: token 0 at position 0, written to and read from the scratch block only
        ids[n:size], pos[n:size], lens[n:size] = 0, 0, 1
        slot[n:size] = self.scratch_block * self.block_size
        rows[n:size, 0] = self.scratch_block
        return width

    def _copy(self, size: int, width: int) -> None:
        """The buffer's prefix in use (the params, the rows' sections, size x width table entries) in one copy."""
        self.copied = self._starts[-1] + size * width
        self.buffer[:self.copied].copy_(self.host[:self.copied], non_blocking=True)

    def _make(self, size: int) -> _Graph:
        params, ids, pos, slots, lens = (self.buffer[a:b] for a, b in zip(self._starts, self._starts[1:],
                                                                           strict=False))
        empty = self.buffer[:0]
        meta = TritonMetadata(
            k_caches=self.k_caches, v_caches=self.v_caches, windows=self.windows, slots=slots[:size],
            # rows params[0] apart (the replay's width), not this view's: the kernel reads the stride it is given
            decode_block_tables=self.buffer[self._starts[-1]:].view(self.sizes[-1], self.width)[:size],
            decode_context_lens=lens[:size], decode_splits=self.splits(size), decode_params=params[:2],
            tile_chunks=empty, tile_rows=empty, chunk_offsets=empty, chunk_lens=empty, chunk_starts=empty,
            chunk_block_tables=empty.view(0, 0))
        keep = self.keep[:size]

        def eager() -> torch.Tensor:
            return self.forward(ids[:size].long(), pos[:size].long(), keep, meta)

        if not self.capture:
            graph = _Graph(size, meta, eager)
        else:
            # Warm up outside the graph (Triton compiles on a first launch; allocator pools settle), then
            # capture. The static buffer holds this step's rows already: the warm-up computes them, and
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

"""The step's backend on a CPU (and on a GPU without Triton): attention in our C kernels where paths.py chose them,
else in torch (engine/attention.attend). Builds a step's CpuMetadata from its inputs; nothing to warm up, no graphs.
The Triton backend (gpu/backend.py) has the same face.
"""

from __future__ import annotations

import numpy as np
import torch

from bulkgen.engine.cpu.attention import kernel_layout, last_level_cache_bytes, shared_decode_pays, shared_items
from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.metadata import ChunkInput, CpuMetadata, PrefillChunk, StepInputs
from bulkgen.errors import ConfigError


class CpuBackend:
    transposed_k = True  # K held transposed in its blocks (metadata.k_block_shape), as the C kernels read it

    def __init__(self, device: torch.device, block_size: int, decode_kernel: Kernels | None,
                 prefill_kernel: Kernels | None, write_kernel: Kernels | None) -> None:
        self.device, self.block_size = device, block_size
        self.decode_kernel, self.prefill_kernel, self.write_kernel = decode_kernel, prefill_kernel, write_kernel
        self.prefill_in_c = False  # set by attach: whether prefill attention reads each chunk's context in C
        self.block_bytes = 0  # set by attach: one block of one layer's K and V

    def uses_graphs(self, cuda_graphs: bool, *_: object) -> bool:
        if cuda_graphs:
            raise ConfigError("--cuda-graphs replays the Triton decode path: it needs a GPU (CUDA) and the Triton "
                              "kernels; use --no-cuda-graphs here")
        return False

    def attach(self, k_caches: list[torch.Tensor]) -> None:
        """The KV cache the steps will read (allocated by the runner)."""
        self.prefill_in_c = self.prefill_kernel is not None and kernel_layout(k_caches[0])
        self.block_bytes = 2 * k_caches[0][0].numel() * k_caches[0].element_size()

    def prepare_run(self, *_: object) -> None:
        """Nothing is compiled or captured on this path."""

    def replay(self, inputs: StepInputs) -> None:
        """No graphs here: every step runs eagerly."""

    def prepare(self, inputs: StepInputs, num_groups: int, **common: object,
                ) -> tuple[list[CpuMetadata], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each group of layers' metadata for the step, and the step's input ids, positions and sampled rows
        (common: metadata.AttentionMetadata's fields)."""
        metas = [self._metadata(inputs, group, common) for group in range(num_groups)]
        ids, pos, keep = (torch.tensor(values, dtype=torch.long, device=self.device)
                          for values in (inputs.input_ids, inputs.positions, inputs.sample_rows))
        return metas, ids, pos, keep

    def _metadata(self, inputs: StepInputs, group: int, common: dict) -> CpuMetadata:
        slots, chunks = inputs.group_slots(group, self.block_size)
        decode_tables = inputs.decode_tables(group)
        max_blocks = max((len(table) for table in decode_tables), default=0)
        tables = np.zeros((len(decode_tables), max_blocks), dtype=np.int32)
        for i, table in enumerate(decode_tables):
            tables[i, :len(table)] = table
        context_lens = inputs.decode_context_lens()
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=self.device)
        return CpuMetadata(
            **common, slots=slot_tensor, slot_blocks=slot_tensor // self.block_size,
            slot_offsets=slot_tensor % self.block_size, num_decode_tokens=len(decode_tables),
            decode_block_tables=torch.from_numpy(tables).to(self.device),
            decode_context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            decode_max_context_len=max(context_lens, default=0),
            decode_shared=self._shared_items(tables, context_lens, decode_tables),
            prefills=[self._chunk(c) for c in chunks],
            decode_kernel=self.decode_kernel, prefill_kernel=self.prefill_kernel, write_kernel=self.write_kernel,
            num_threads=torch.get_num_threads())

    def _shared_items(self, tables: np.ndarray, context_lens: list[int], decode_tables: list,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The decode's shared work items (attention.shared_items), where the C kernel runs and they pay here."""
        if self.decode_kernel is None or len(context_lens) < 2:
            return None
        # the blocks read by several sequences, counted in the sequences' own tables (not the padded rows)
        _, users = np.unique(np.concatenate(decode_tables), return_counts=True)
        if not shared_decode_pays(int((users > 1).sum()), self.block_bytes, last_level_cache_bytes()):
            return None
        return shared_items(tables, context_lens, self.block_size)

    def _chunk(self, c: ChunkInput) -> PrefillChunk:
        chunk = PrefillChunk(offset=c.offset, num_tokens=c.num_tokens, start=c.start)
        if self.prefill_in_c:
            chunk.block_table = torch.tensor(c.table, dtype=torch.int32)
        elif c.start:
            chunk.context_blocks = torch.from_numpy(c.context_slots // self.block_size).to(self.device)
            chunk.context_offsets = torch.from_numpy(c.context_slots % self.block_size).to(self.device)
            if c.start > c.num_tokens:  # else attention pads the queries instead (see attention.attend)
                q_pos = torch.arange(c.start, c.start + c.num_tokens, device=self.device)
                chunk.mask = q_pos[:, None] >= torch.arange(c.start + c.num_tokens, device=self.device)[None, :]
        return chunk

"""The step's backend where attention, the KV write and the small ops run in Triton (a GPU, or tests in Triton's
interpreter): a step's TritonMetadata in one copy to the device (step.py), and before the first request the
warm-up that compiles every kernel variant a run meets and the decode graphs' capture (graphs.py). The CPU backend
(cpu/backend.py) has the same face.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from bulkgen.engine.gpu import attention as triton_attention
from bulkgen.engine.gpu.graphs import DecodeGraphs
from bulkgen.engine.gpu.step import triton_step
from bulkgen.engine.metadata import StepInputs, TritonMetadata
from bulkgen.errors import ConfigError

log = logging.getLogger(__name__)


class TritonBackend:
    transposed_k = False  # the Triton kernels read K as V (metadata.k_block_shape)

    def __init__(self, device: torch.device, block_size: int, num_kv_heads: int, num_heads: int) -> None:
        if block_size < triton_attention.MIN_DOT:
            raise ConfigError(f"the Triton kernels take KV blocks of at least {triton_attention.MIN_DOT} tokens "
                              f"(tensor-core tiles); got --block-size {block_size}")
        self.device, self.block_size = device, block_size
        self.num_kv_heads, self.group = num_kv_heads, num_heads // num_kv_heads
        self.graphs: DecodeGraphs | None = None  # built by prepare_run, when graphs are on

    def uses_graphs(self, cuda_graphs: bool, lean: bool, num_groups: int, model_name: str) -> bool:
        """Whether decode steps replay CUDA graphs (gpu/graphs.py): asked for, the lean forward, one group of layers."""
        if not cuda_graphs:
            return False
        if not lean:
            log.warning("bulkgen: %s runs through Hugging Face's modules: decode steps run without CUDA graphs",
                        model_name)
            return False
        if num_groups > 1:
            log.warning("bulkgen: %s's layers hold their K/V in %d groups (full and sliding-window attention): "
                        "decode steps run without CUDA graphs", model_name, num_groups)
            return False
        return True

    def attach(self, k_caches: list[torch.Tensor]) -> None:
        """The KV cache the steps will read (the Triton kernels need nothing more of it)."""

    def prepare_run(self, execute: Callable[[list], object], warm_up_seq: Callable[[int, int, int], object],
                    max_model_len: int, graphs: Callable[[], DecodeGraphs] | None) -> None:
        """Before the first request, on a GPU: the warm-up and every decode graph's capture (their block tables
        max_model_len wide), so that the run compiles and captures nothing. graphs: builds them, where they are on."""
        if self.device.type == "cuda":
            self.warm_up(execute, warm_up_seq, max_model_len)
        if graphs is not None:
            self.graphs = graphs()
            self.graphs.capture_all()

    def warm_up(self, execute: Callable[[list], object], warm_up_seq: Callable[[int, int, int], object],
                max_model_len: int) -> list[int]:
        """Before any request, a step for each decode split count a run can meet, and a mixed step (a decode and a
        prefill chunk): Triton compiles a kernel variant on its first launch, a second or two on a GPU, and those
        would fall inside the run (tests/test_triton_specializations.py checks that a run asks for none past these).
        warm_up_seq(num_tokens, num_blocks, num_new): a scheduled sequence whose blocks are all block 0, which
        nothing holds yet. Returns the split counts."""
        bs, kv_heads = self.block_size, self.num_kv_heads
        max_blocks = -(-max_model_len // bs)

        def splits(num_blocks: int) -> int:  # as step.py chooses them for one sequence
            return triton_attention.decode_splits(1, kv_heads, num_blocks,
                                                  triton_attention.decode_programs(self.device, 1, kv_heads))

        widths = {}  # split count -> a table width that gives it; fewer sequences never give fewer splits
        width = 1
        while width <= max_blocks:
            widths.setdefault(splits(width), width)
            width *= 2
        widths.setdefault(splits(max_blocks), max_blocks)
        for width in widths.values():
            execute([warm_up_seq(min(width * bs, max_model_len), width, 1)])
        execute([warm_up_seq(1, 1, 1), warm_up_seq(2, 1, 2)])
        return sorted(widths)

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """A pure-decode step that a captured graph takes: its logits (sampled rows); else None."""
        graphs, decodes = self.graphs, inputs.decodes
        if graphs is None or inputs.prefills or graphs.bucket(len(decodes)) is None \
                or any(len(seq.block_table) > graphs.width for seq, _ in decodes):
            return None
        slots, _ = inputs.group_slots(0, self.block_size)
        logits = graphs.run(inputs.input_ids, inputs.positions, slots, inputs.decode_tables(0),
                            inputs.decode_context_lens())
        return logits if len(inputs.sample_rows) == len(decodes) else logits[inputs.sample_rows]

    def prepare(self, inputs: StepInputs, num_groups: int, **common: object,
                ) -> tuple[list[TritonMetadata], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each group of layers' metadata for the step, and the step's input ids, positions and sampled rows, which
        travel in the first group's one copy to the device (common: metadata.AttentionMetadata's fields)."""
        metas, step = [], ()
        for group in range(num_groups):
            slots, chunks = inputs.group_slots(group, self.block_size)
            first = not group
            meta, ids, pos, keep = triton_step(
                inputs.input_ids if first else [], inputs.positions if first else [],
                inputs.sample_rows if first else [], slots, inputs.decode_tables(group), inputs.decode_context_lens(),
                [(c.offset, c.num_tokens, c.start, c.table) for c in chunks], self.device, self.num_kv_heads,
                self.group, **common)
            metas.append(meta)
            step = (ids, pos, keep) if first else step
        return metas, *step

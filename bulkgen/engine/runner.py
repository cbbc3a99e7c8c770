"""The model runner owns torch: it loads the model, holds the KV cache, and runs one step.

Built in phases, each a function of its own: load (loading.py: device, dtype, quantization, weights) → compute (the
kernels' paths, the lean forward or Hugging Face's modules, the linear layers packed or quantized) → probe
(probe.py, for Hugging Face's modules: each layer's attention and window) → allocate the KV cache → before the first
request, the backend's warm-up and decode graphs (gpu/backend.py; nothing on a CPU). The backend is chosen once:
C kernels and torch (cpu/backend.py) or Triton (gpu/backend.py).

A step (`execute`) flattens the scheduled tokens into one ragged batch (decodes first, then prefill chunks:
metadata.StepInputs), so the linear layers see no padding and only the positions that need sampling reach the LM
head; the backend builds the step's attention metadata; then the forward pass: the Llama family through our lean
forward (llama.py), other models through their Hugging Face modules with our attention plugged in.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bulkgen.config import SamplingParams, parse_kernels
from bulkgen.engine import attention, llama
from bulkgen.engine.block_manager import KVLayout
from bulkgen.engine.cpu.backend import CpuBackend
from bulkgen.engine.cpu.machine import release_freed_memory
from bulkgen.engine.cpu.ops import Ops
from bulkgen.engine.kv_cache import MIN_KV_BLOCKS, KVCache
from bulkgen.engine.layers import pack_linears
from bulkgen.engine.loading import Plan, load
from bulkgen.engine.metadata import ProbeRecord, StepInputs
from bulkgen.engine.paths import paths_for
from bulkgen.engine.probe import probe
from bulkgen.engine.quant import quantize_linears
from bulkgen.engine.scheduler import ScheduledSeq
from bulkgen.engine.sequence import Sequence
from bulkgen.model import ModelShape, context_length

if TYPE_CHECKING:  # a type only: triton is optional
    from bulkgen.engine.gpu.backend import TritonBackend

log = logging.getLogger(__name__)


class ModelRunner:
    """What the engine reads: `model`, `device`, `paths`, `ops`, `layout`, `num_blocks`, `kv` and `kv_cache_bytes`,
    `max_model_len`, `max_num_tokens`, `weight_kinds()`; `prepare_run()` once, then `execute(scheduled)` a step.
    plan: how the model runs (loading.plan: the engine makes it, and the config comes no further back)."""

    def __init__(self, model: str | Path | torch.nn.Module, plan: Plan) -> None:
        self.config = config = plan.config
        self.device, self.dtype = plan.device, plan.dtype
        self.model, self._weight_kinds = load(model, plan)
        self.shape = ModelShape.of(self.model.config)
        # the engine's cap on a sequence's tokens: the KV cache's default size and decode graphs' tables follow it
        context = context_length(self.model.config, str(self.model.config._name_or_path or type(self.model).__name__))
        self.max_model_len = min(config.max_model_len or context, context)
        self._compute(plan.triton)
        self.backend = self._backend(plan.triton)
        self.windows = self.shape.windows if self.shape.window else ()  # each layer's sliding window, if any
        if self.forward is None:  # in a cache of a few blocks: the probe reads the windows the real one is laid out by
            self._allocate(KVLayout.of(self.shape.num_layers), False, MIN_KV_BLOCKS + 1)
            self.windows = probe(self.model, self.shape.num_layers, self.windows, self.execute)
        # Layers that attend alike share block tables; a sliding group holds its window (block_manager.KVLayout)
        self.layout = KVLayout.of(self.shape.num_layers, self.windows)
        # CUDA graphs pad decode steps with rows that write a scratch block no sequence owns (gpu/graphs.py)
        self.use_graphs = self.backend.uses_graphs(config.cuda_graphs, self.forward is not None,
                                                   self.layout.num_groups, type(self.model).__name__)
        self._allocate(self.layout, self.use_graphs)

    def _compute(self, triton: bool) -> None:
        """The kernels' paths (C or torch per family, paths.py), the small ops, and the forward: the lean one where
        the model is of the Llama family (its linear layers packed or quantized there), else Hugging Face's modules
        with their linear layers packed or quantized in place."""
        config = self.config
        lean = config.fast_forward and llama.unsupported_reason(self.model) is None
        self.paths = paths_for(config, self.device, self.dtype, triton, self.shape, lean)
        self.kernel = self.paths.kernel
        self.ops = _triton_ops() if triton else Ops(self.paths.c("small_ops"), self.dtype, self.paths.c("sampler"))
        int8 = config.quantization == "int8"
        # the int8 products in C wherever the kernels load (qgemm.c: no faster path here), unless --kernels forces
        # the linear layers to torch
        int8_kernel = None if parse_kernels(config.kernels).get("linear") == "torch" else self.kernel
        if int8 and self.device.type == "cpu" and not (int8_kernel and int8_kernel.qlinear_available()):
            log.warning("bulkgen: --quantization int8 without AVX2 runs its products in plain C or torch: "
                        "correct, but slower than --quantization none on this CPU")
        elif int8 and self.device.type == "cpu" and int8_kernel is not None and int8_kernel.amx:
            log.warning("bulkgen: --quantization int8 runs on AVX512-VNNI here, while bfloat16 runs on AMX tiles: "
                        "it saves memory on this CPU, not time (0.71x --dtype bfloat16 at 1B, BENCHMARKS.md); "
                        "--quantization none --dtype bfloat16 is faster where the weights fit")
        self.forward = llama.make_forward(self.model, self.ops, config.pack_weights, self.paths.c("linear"),
                                          self.paths.c("gated_mlp"), int8, int8_kernel) if lean else None
        if self.forward is None and int8:
            quantize_linears(self.model, int8_kernel)
        elif self.forward is None and config.pack_weights and self.device.type == "cpu":
            pack_linears(self.model)
        if self.device.type == "cpu":
            release_freed_memory()  # the load's temporaries

    def _backend(self, triton: bool) -> CpuBackend | TritonBackend:
        if triton:
            from bulkgen.engine.gpu.backend import TritonBackend  # here: triton is optional

            return TritonBackend(self.device, self.config.block_size, self.shape.num_kv_heads, self.shape.num_heads)
        paths = self.paths
        return CpuBackend(self.device, self.config.block_size, paths.c("decode_attention"),
                          paths.c("prefill_attention"), paths.c("small_ops"))

    def _allocate(self, layout: KVLayout, scratch: bool, num_blocks: int | None = None) -> None:
        """The KV cache (of num_blocks blocks where given, else of the configured budget; a scratch block for the
        decode graphs' padding rows)."""
        config = self.config
        if num_blocks is not None:
            bytes_per_block = self.shape.kv_bytes_per_token(config.dtype) * config.block_size
            config = dataclasses.replace(config, kv_cache_memory=num_blocks * bytes_per_block)
        self.kv = KVCache(self.shape, config, self.dtype, self.device, num_scratch_blocks=int(scratch),
                          transposed_k=self.backend.transposed_k, layout=layout, max_context=self.max_model_len)
        self.num_blocks, self.kv_cache_bytes = self.kv.num_blocks, self.kv.num_bytes
        self.backend.attach(self.kv.k_caches)

    def weight_kinds(self) -> str:
        """The linear layers' GGUF types, most layers first: "Q4_K + Q6_K" (--quantization gguf)."""
        return " + ".join(kind for kind, _ in self._weight_kinds.most_common())

    def prepare_run(self) -> None:
        """Before the first request: what the backend compiles and captures (on a GPU: the warm-up, every decode
        graph), so that the run compiles and captures nothing."""
        self.backend.prepare_run(self.execute, warm_up_seq(self.layout.num_groups), self.max_model_len,
                                 self._decode_graphs if self.use_graphs else None)

    def _decode_graphs(self) -> object:
        from bulkgen.engine.gpu.graphs import DecodeGraphs  # here: triton is optional

        return DecodeGraphs(
            self.forward, self.kv.k_caches, self.kv.v_caches, scratch_block=self.kv.scratch_block,
            block_size=self.config.block_size, max_blocks_per_seq=-(-self.max_model_len // self.config.block_size),
            max_num_seqs=self.config.max_num_seqs, num_kv_heads=self.shape.num_kv_heads, device=self.device,
            windows=self.windows)

    @property
    def max_num_tokens(self) -> int:
        return self.kv.max_num_tokens

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], probe: ProbeRecord | None = None,
                ) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step. Returns float32 logits [num_sampled, vocab] and the sequences they belong to:
        those whose computed tokens reach their known tokens this step. probe: what the probe's step records."""
        inputs = StepInputs.of(scheduled)
        logits = self.backend.replay(inputs)
        if logits is not None:
            return logits, inputs.sampled
        # one set of slots and block tables a group of layers (KVLayout); every layer's attention reads its group's
        layout = self.kv.layout
        metas, ids, pos, keep = self.backend.prepare(inputs, layout.num_groups, k_caches=self.kv.k_caches,
                                                     v_caches=self.kv.v_caches, windows=self.windows, probe=probe)
        meta = metas[0]
        if len(metas) > 1:
            meta.groups, meta.layer_groups = metas, layout.layer_groups
        return self._forward(ids, pos, keep, meta), inputs.sampled

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, meta: object) -> torch.Tensor:
        if self.forward is not None:
            return self.forward(ids, pos, keep, meta).float()
        with attention.step(meta):
            output = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep)
        return output.logits[0].float()


def warm_up_seq(num_groups: int) -> object:
    """The warm-up's scheduled sequences (gpu/backend.warm_up): num_tokens tokens, all of whose num_blocks blocks a
    group are block 0, which nothing holds before the run, num_new of them computed in the step."""

    def make(num_tokens: int, num_blocks: int, num_new: int) -> ScheduledSeq:
        seq = Sequence("warm-up", [0] * num_tokens, SamplingParams(max_new_tokens=1))
        seq.block_tables = [[0] * num_blocks for _ in range(num_groups)]
        seq.num_computed_tokens = num_tokens - num_new
        return ScheduledSeq(seq, num_new)

    return make


def _triton_ops() -> object:
    from bulkgen.engine.gpu.ops import TritonOps  # here: triton is optional (a CPU install has none)

    return TritonOps()

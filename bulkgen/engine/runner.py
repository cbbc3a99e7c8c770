# Whole (over 300 lines): loading, the KV cache and one step share the runner's tensors; kernels, attention and layers
# live in modules of their own.
"""The model runner owns torch: it loads the model, holds the KV cache, and runs one step.

A step's scheduled tokens are flattened into one ragged batch (decodes first, then prefill chunks),
so the linear layers see no padding, and only the positions that need sampling reach the LM head.
The Llama family runs through our lean forward (llama.py); other models through their Hugging Face
modules with our attention plugged in. Kernels by device: cpu/ (C kernels, chosen per family by
cpu/paths.py) and gpu/ (Triton); torch is the reference and the floor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import torch

from bulkgen.config import DTYPES, EngineConfig, SamplingParams, parse_kernels
from bulkgen.engine import attention, llama, memory
from bulkgen.engine.block_manager import KVLayout
from bulkgen.engine.cpu.attention import kernel_layout
from bulkgen.engine.cpu.kernels import load_cpu_kernels
from bulkgen.engine.cpu.machine import check_dtype_fits, keep_freed_memory, release_freed_memory
from bulkgen.engine.cpu.ops import Ops
from bulkgen.engine.cpu.paths import paths_for
from bulkgen.engine.families import unsupported_features
from bulkgen.engine.gguf_load import load_gguf, weight_kinds
from bulkgen.engine.kv_cache import MIN_KV_BLOCKS, KVCache
from bulkgen.engine.layers import pack_linears
from bulkgen.engine.quant import quantize_linears
from bulkgen.engine.scheduler import ScheduledSeq
from bulkgen.engine.sequence import Sequence
from bulkgen.errors import ConfigError, ModelError
from bulkgen.gguf_info import GGUFInfo, gguf_info
from bulkgen.model import HF_LOAD_LOCK, ModelShape, context_length

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES, as torch names them


class ModelRunner:
    def __init__(self, model: str | Path | torch.nn.Module, config: EngineConfig) -> None:
        self.device = _device(config.device)
        quantization, gguf = _quantization(model, config, self.device)
        dtype = _weights_dtype(model, config, self.device, gguf if quantization == "gguf" else None)
        self.config = config = dataclasses.replace(config, dtype=dtype, quantization=quantization)
        self.dtype = TORCH_DTYPES[config.dtype]
        if self.device.type == "cpu":
            check_dtype_fits(config.dtype)
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            keep_freed_memory()
        if gguf is not None and quantization == "gguf":  # the linear layers in the file's own blocks
            in_c = self.device.type == "cpu" and not _use_triton(self.device, config.attention_backend) \
                and parse_kernels(config.kernels).get("linear") != "torch"  # as the int8 layers choose
            blocks_kernel = load_cpu_kernels() if in_c else None
            self.model = _checked(load_gguf(gguf.gguf, Path(model), self.dtype, blocks_kernel)).to(self.device)
        else:
            self.model = _load(model, self.dtype, self.device)
        self._weight_kinds = weight_kinds(self.model)  # GGUF blocks' types, before the lean forward takes them
        self.shape = ModelShape.of(self.model.config)
        # the engine's cap on a sequence's tokens: the KV cache's default size and decode graphs' tables follow it
        context = context_length(self.model.config, str(self.model.config._name_or_path or type(self.model).__name__))
        self.max_model_len = min(config.max_model_len or context, context)
        self.windows = self.shape.windows if self.shape.window else ()  # each layer's sliding window, if any
        # Triton kernels for attention, the KV write and the small ops: on a GPU, or (tests) in Triton's CPU
        # interpreter when asked for
        self.use_triton = _use_triton(self.device, config.attention_backend)
        lean = config.fast_forward and llama.unsupported_reason(self.model) is None
        self.paths = paths_for(config, self.device, self.dtype, self.use_triton, self.shape, lean)
        self.kernel = self.paths.kernel
        self.ops = _triton_ops() if self.use_triton \
            else Ops(self.paths.c("small_ops"), self.dtype, self.paths.c("sampler"))
        int8 = config.quantization == "int8"
        # the int8 products in C wherever the kernels load (qgemm.c: no faster path here), unless --kernels forces
        # the linear layers to torch
        int8_kernel = None if parse_kernels(config.kernels).get("linear") == "torch" else self.kernel
        if int8 and self.device.type == "cpu" and not (int8_kernel and int8_kernel.qlinear_available()):
            log.warning("bulkgen: --quantization int8 without AVX2 runs its products in plain C or torch: "
                        "correct, but slower than --quantization none on this CPU")
        self.forward = llama.make_forward(self.model, self.ops, config.pack_weights, self.paths.c("linear"),
                                          self.paths.c("gated_mlp"), int8, int8_kernel) if lean else None
        if self.forward is None and int8:
            quantize_linears(self.model, int8_kernel)
        elif self.forward is None and config.pack_weights and self.device.type == "cpu":
            pack_linears(self.model)
        if self.device.type == "cpu":
            release_freed_memory()  # the load's temporaries
        self.block_size = config.block_size
        if self.use_triton and self.block_size < triton_min_block():
            raise ConfigError(f"the Triton kernels take KV blocks of at least {triton_min_block()} tokens (tensor-core "
                              f"tiles); got --block-size {self.block_size}")
        self.decode_graphs = None  # built by prepare_run, when graphs are on
        self.use_graphs = False
        self._calls: list[int] | None = None  # set while probing: the layers whose attention reached ours
        self._mask_windows: dict[int, int] | None = None  # and the window each one's own mask gives
        if self.forward is None:  # in a cache of a few blocks: the probe reads the windows the real one is laid out by
            self._make_cache(KVLayout.of(self.shape.num_layers), MIN_KV_BLOCKS + 1)
            self._probe()
        # Layers that attend alike share block tables; a sliding group holds its window (block_manager.KVLayout)
        self.layout = KVLayout.of(self.shape.num_layers, self.windows)
        # CUDA graphs pad decode steps with rows that write a scratch block no sequence owns (gpu/graphs.py)
        self.use_graphs = self._use_graphs()
        self._make_cache(self.layout)

    def weight_kinds(self) -> str:
        """The linear layers' GGUF types, most layers first: "Q4_K + Q6_K" (--quantization gguf)."""
        return " + ".join(kind for kind, _ in self._weight_kinds.most_common())

    def _make_cache(self, layout: KVLayout, num_blocks: int | None = None) -> None:
        """The KV cache (of num_blocks blocks where given, else of the configured budget) and what reads it."""
        config = self.config
        if num_blocks is not None:
            bytes_per_block = self.shape.kv_bytes_per_token(config.dtype) * config.block_size
            config = dataclasses.replace(config, kv_cache_memory=num_blocks * bytes_per_block)
        self.kv = KVCache(self.shape, config, self.dtype, self.device, num_scratch_blocks=int(self.use_graphs),
                          transposed_k=not self.use_triton, layout=layout, max_context=self.max_model_len)
        self.num_blocks, self.kv_cache_bytes = self.kv.num_blocks, self.kv.num_bytes
        self._k_caches, self._v_caches = self.kv.k_caches, self.kv.v_caches
        # Whether prefill attention runs in our C kernel (it reads each chunk's context from the blocks itself)
        self.prefill_in_c = self.paths.c("prefill_attention") is not None \
            and kernel_layout(self._k_caches[0])

    def _probe(self) -> None:
        """Two tokens through the model's own modules at load, before any request is taken: every layer's
        attention must come through bulkgen's attention function once, causal, with K/V shaped as the cache
        (attention.paged_attention_forward checks each call), and each layer's window is read off the mask
        the model's own code builds for it (attention.mask_span). A model whose attention goes elsewhere
        (written into its modules, shared between layers, an encoder's) would run to other outputs than its
        own: it is refused here, with the model's class and what it does. The probe writes block 0, which
        nothing holds yet."""
        name = type(self.model).__name__
        try:
            try:
                calls, windows = self._probe_step(read_masks=True)
            except ModelError:
                raise
            except Exception:  # a module that reads its mask itself: probe again, windows read from the config
                calls, windows = self._probe_step(read_masks=False)
        except ModelError as exc:
            if str(exc).startswith(name):
                raise
            raise ModelError(f"{name}: {exc}") from exc
        except Exception as exc:  # a model's modules may fail in any way on bulkgen's inputs
            raise ModelError(f"{name} fails on a first step through bulkgen's attention ({type(exc).__name__}: "
                             f"{exc}): bulkgen cannot run this model") from exc
        if sorted(calls) != list(range(self.shape.num_layers)):
            raise ModelError(f"{name} calls bulkgen's attention {len(calls)} times for its {self.shape.num_layers} "
                             f"layers (from layers {sorted(set(calls))}), where the paged KV cache holds one call's "
                             "K/V a layer: its attention does not run through transformers' attention interface as "
                             "bulkgen needs, so bulkgen cannot run it exactly")
        if len(windows) == self.shape.num_layers:  # each layer's mask, as the model's own code built it
            read = tuple(windows[i] for i in range(self.shape.num_layers))
            if read != (self.windows or (0,) * self.shape.num_layers):
                log.info("bulkgen: %s's masks give windows %s where its config reads %s; the masks are the model's",
                         name, read, self.windows)
            self.windows = read if any(read) else ()

    def _probe_step(self, read_masks: bool) -> tuple[list[int], dict[int, int]]:
        """One two-token step; the layers whose attention reached bulkgen's, and the window each one's mask gave."""
        seq = Sequence("probe", [0, 0], SamplingParams(max_new_tokens=1))
        seq.block_table = [0]
        self._calls, self._mask_windows = [], {}
        try:
            if read_masks:
                with attention.reading_masks():
                    self.execute([ScheduledSeq(seq, 2)])
            else:
                self.execute([ScheduledSeq(seq, 2)])
            return self._calls, self._mask_windows
        finally:
            self._calls, self._mask_windows = None, None

    def prepare_run(self) -> None:
        """Before the first request, on a GPU: the warm-up and every decode graph's capture (their block tables
        max_model_len wide), so that the run compiles and captures nothing."""
        if self.use_triton and self.device.type == "cuda":
            self.warm_up()
        if self.use_graphs:
            from bulkgen.engine.gpu.graphs import DecodeGraphs  # here: triton is optional

            self.decode_graphs = DecodeGraphs(
                self.forward, self._k_caches, self._v_caches, scratch_block=self.kv.scratch_block,
                block_size=self.block_size,
                max_blocks_per_seq=-(-self.max_model_len // self.block_size), max_num_seqs=self.config.max_num_seqs,
                num_kv_heads=self.shape.num_kv_heads, device=self.device, windows=self.windows)
            self.decode_graphs.capture_all()

    def warm_up(self) -> list[int]:
        """Triton path: before any request, a step for each decode split count a run can meet, and a mixed step
        (a decode and a prefill chunk): Triton compiles a kernel variant on its first launch, a second or two on a
        GPU, and those would fall inside the run (tests/test_triton_specializations.py checks that a run asks for
        none past these). Its steps write block 0 only, which nothing holds yet. Returns the split counts."""
        bs, groups = self.block_size, self.layout.num_groups
        max_blocks = -(-self.max_model_len // bs)

        def sequence(num_tokens: int, num_blocks: int, num_new: int) -> ScheduledSeq:
            seq = Sequence("warm-up", [0] * num_tokens, SamplingParams(max_new_tokens=1))
            seq.block_tables = [[0] * num_blocks for _ in range(groups)]
            seq.num_computed_tokens = num_tokens - num_new
            return ScheduledSeq(seq, num_new)

        from bulkgen.engine.gpu import attention as triton_attention  # here: triton is optional

        def splits(num_blocks: int) -> int:  # as gpu/step.py chooses them for one sequence
            kv_heads = self.shape.num_kv_heads
            return triton_attention.decode_splits(1, kv_heads, num_blocks,
                                                  triton_attention.decode_programs(self.device, 1, kv_heads))

        widths = {}  # split count -> a table width that gives it; fewer sequences never give fewer splits
        width = 1
        while width <= max_blocks:
            widths.setdefault(splits(width), width)
            width *= 2
        widths.setdefault(splits(max_blocks), max_blocks)
        for width in widths.values():
            self.execute([sequence(min(width * bs, self.max_model_len), width, 1)])
        self.execute([sequence(1, 1, 1), sequence(2, 1, 2)])
        return sorted(widths)

    def _use_graphs(self) -> bool:
        if not self.config.cuda_graphs:
            return False
        if not self.use_triton:
            raise ConfigError("--cuda-graphs replays the Triton decode path: it needs a GPU (CUDA) and the Triton "
                              "kernels; use --no-cuda-graphs here")
        if self.forward is None:
            log.warning("bulkgen: %s runs through Hugging Face's modules: decode steps run without CUDA graphs",
                        type(self.model).__name__)
            return False
        if self.layout.num_groups > 1:
            log.warning("bulkgen: %s's layers hold their K/V in %d groups (full and sliding-window attention): "
                        "decode steps run without CUDA graphs", type(self.model).__name__, self.layout.num_groups)
            return False
        return True

    @property
    def max_num_tokens(self) -> int:
        return self.kv.max_num_tokens

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step. Returns float32 logits [num_sampled, vocab] and the sequences they belong to:
        those whose computed tokens reach their known tokens this step."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for s in decodes:
            input_ids.append(s.seq.token_ids[s.seq.num_computed_tokens])
            positions.append(s.seq.num_computed_tokens)
        for s in prefills:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            input_ids.extend(s.seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
        offset = 0
        for s in decodes + prefills:
            offset += s.num_new_tokens
            if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens:
                sample_rows.append(offset - 1)
                sampled.append(s.seq)
        graphs = self.decode_graphs
        if graphs is not None and not prefills and graphs.bucket(len(decodes)) is not None \
                and all(len(s.seq.block_table) <= graphs.width for s in decodes):
            slots, _ = self._group_slots(0, decodes, prefills)
            logits = graphs.run(input_ids, positions, slots, [s.seq.block_table for s in decodes],
                                [s.seq.num_computed_tokens + 1 for s in decodes])
            return (logits if len(sample_rows) == len(decodes) else logits[sample_rows]), sampled
        # one set of slots and block tables a group of layers (KVLayout); every layer's attention reads its group's
        metas = []
        for g in range(self.kv.layout.num_groups):
            slots, chunks = self._group_slots(g, decodes, prefills)
            tables = [s.seq.block_tables[g] for s in decodes]
            if not self.use_triton:
                metas.append(self._metadata(decodes, tables, slots, chunks))
            elif not g:  # the step's inputs travel in the first group's one copy
                meta, ids, pos, keep = self._triton_inputs(decodes, tables, input_ids, positions, sample_rows, slots,
                                                           chunks)
                metas.append(meta)
            else:
                metas.append(self._triton_inputs(decodes, tables, [], [], [], slots, chunks)[0])
        if not self.use_triton:
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            keep = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        meta = metas[0]
        if len(metas) > 1:
            meta.groups, meta.layer_groups = metas, self.kv.layout.layer_groups
        if self.forward is not None:
            return self.forward(ids, pos, keep, meta).float(), sampled
        with attention.step(meta):
            output = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep)
        return output.logits[0].float(), sampled

    def _group_slots(self, group: int, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq],
                     ) -> tuple[list[int], list[attention.PrefillChunk]]:
        """The cache slots of the step's new tokens in one group's blocks, and its prefill chunks."""
        bs = self.block_size
        slots: list[int] = []
        for s in decodes:
            pos = s.seq.num_computed_tokens
            slots.append(s.seq.block_tables[group][pos // bs] * bs + pos % bs)
        chunks: list[attention.PrefillChunk] = []
        offset = len(decodes)
        for s in prefills:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            table = seq.block_tables[group]
            chunk = attention.PrefillChunk(offset=offset, num_tokens=n, start=start)
            offset += n
            context_slots = _slots(table, bs, 0, start + n)  # the chunk's and its context's
            slots.extend(context_slots[start:].tolist())
            if self.use_triton:
                chunk.block_table = table  # a list: gpu/step.py packs it with the rest
            elif self.prefill_in_c:
                chunk.block_table = torch.tensor(table, dtype=torch.int32)
            elif start:
                chunk.context_blocks = torch.from_numpy(context_slots // bs).to(self.device)
                chunk.context_offsets = torch.from_numpy(context_slots % bs).to(self.device)
                if start > n:  # else attention pads the queries instead (see attention.attend)
                    q_pos = torch.arange(start, start + n, device=self.device)
                    chunk.mask = q_pos[:, None] >= torch.arange(start + n, device=self.device)[None, :]
            chunks.append(chunk)
        return slots, chunks

    def _triton_inputs(self, decodes: list[ScheduledSeq], tables: list[list[int]], input_ids: list[int],
                       positions: list[int], sample_rows: list[int], slots: list[int],
                       chunks: list[attention.PrefillChunk],
                       ) -> tuple[attention.AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's inputs and attention metadata in one copy to the device (gpu/step.py)."""
        from bulkgen.engine.gpu.step import triton_step  # here: triton is optional

        group = self.shape.num_heads // self.shape.num_kv_heads
        step, ids, pos, keep = triton_step(input_ids, positions, sample_rows, slots, tables,
                                           [s.seq.num_computed_tokens + 1 for s in decodes],
                                           [(c.offset, c.num_tokens, c.start, c.block_table) for c in chunks],
                                           self.device, self.shape.num_kv_heads, group)
        meta = attention.AttentionMetadata(
            k_caches=self._k_caches, v_caches=self._v_caches, slots=step.slots, slot_blocks=step.slots,
            slot_offsets=step.slots, num_decode_tokens=len(decodes), decode_block_tables=step.decode_block_tables,
            decode_context_lens=step.decode_context_lens, decode_max_context_len=0, triton=step,
            windows=self.windows, calls=self._calls, mask_windows=self._mask_windows)
        return meta, ids, pos, keep

    def _metadata(self, decodes: list[ScheduledSeq], decode_tables: list[list[int]], slots: list[int],
                  chunks: list[attention.PrefillChunk]) -> attention.AttentionMetadata:
        num_decodes = len(decodes)
        max_blocks = max((len(table) for table in decode_tables), default=0)
        tables = np.zeros((num_decodes, max_blocks), dtype=np.int32)
        for i, table in enumerate(decode_tables):
            tables[i, :len(table)] = table
        context_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=self.device)
        return attention.AttentionMetadata(
            k_caches=self._k_caches, v_caches=self._v_caches, slots=slot_tensor,
            slot_blocks=slot_tensor // self.block_size, slot_offsets=slot_tensor % self.block_size,
            num_decode_tokens=num_decodes,
            decode_block_tables=torch.from_numpy(tables).to(self.device),
            decode_context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            decode_max_context_len=max(context_lens, default=0),
            prefills=chunks, windows=self.windows, calls=self._calls, mask_windows=self._mask_windows,
            decode_kernel=self.paths.c("decode_attention"),
            prefill_kernel=self.paths.c("prefill_attention"), write_kernel=self.paths.c("small_ops"),
            num_threads=torch.get_num_threads(),
        )


def _slots(block_table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots of positions [start, end): block_table[p // block_size] * block_size + p % block_size.

        positions   0 1 2 3 | 4 5 6 7 | 8 9        (block_size 4)
        block_table [  7    ,    2    ,  5 ]
        slots       28 .. 31| 8 .. 11 | 20 21
    """
    positions = np.arange(start, end)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _triton_ops() -> object:
    from bulkgen.engine.gpu.ops import TritonOps  # here: triton is optional (a CPU install has none)

    return TritonOps()


def triton_min_block() -> int:
    from bulkgen.engine.gpu.attention import MIN_DOT  # here: triton is optional

    return MIN_DOT


def _use_triton(device: torch.device, backend: str) -> bool:
    """Triton on a GPU (unless --attention-backend torch); on CPU only when asked, in the interpreter."""
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ConfigError("--attention-backend triton runs Triton's GPU kernels; on a CPU only in Triton's "
                          "interpreter (TRITON_INTERPRET=1, for tests): use auto, kernel or torch here")
    wanted = backend == "triton" or (device.type == "cuda" and backend == "auto")
    if not wanted:
        return False
    try:
        import triton  # noqa: F401  (ships with every CUDA build of torch)
    except ImportError as exc:
        if backend == "triton":
            raise ConfigError("--attention-backend triton needs the triton package (pip install triton)") from exc
        log.warning("bulkgen: triton is not installed; attention runs in torch (slower on a GPU)")
        return False
    return True


def _quantization(model: str | Path | torch.nn.Module, config: EngineConfig,
                  device: torch.device) -> tuple[str, GGUFInfo | None]:
    """--quantization as it runs (auto: none, the exact path, where the dequantized weights fit in memory, else
    the GGUF file's blocks), and the model's GGUF file where it came from one. Checked before anything loads."""
    gguf = None if isinstance(model, torch.nn.Module) else gguf_info(Path(model))
    requested = config.quantization
    if requested == "gguf" and gguf is None:
        raise ConfigError(f"--quantization gguf runs a GGUF file's own blocks, and {_name(model)} did not come from "
                          "one: give a .gguf file, the default model, or a hub name with :QUANT (or use "
                          "--quantization int8)")
    if gguf is not None and not gguf.weights and requested in ("none", "int8"):
        raise ConfigError(f"{gguf.gguf.name} dequantized does not fit in this machine's memory, so only its blocks "
                          f"were kept: run it with --quantization gguf (or auto)")
    if requested != "auto":
        return requested, gguf
    if gguf is None:
        return "none", None
    if gguf.weights:
        try:
            memory.dtype_for(config.dtype, Path(model), config.kv_cache_memory, device.type == "cuda")
            return "none", gguf
        except ConfigError:
            pass
    return "gguf", gguf


def _name(model: str | Path | torch.nn.Module) -> str:
    return type(model).__name__ if isinstance(model, torch.nn.Module) else Path(model).name


def _weights_dtype(model: str | Path | torch.nn.Module, config: EngineConfig, device: torch.device,
                   gguf: GGUFInfo | None = None) -> str:
    """The dtype the weights load in: --dtype, or for auto what fits (engine/memory.py; with gguf, the weights
    not kept in its blocks); checked before anything is loaded."""
    on_gpu = device.type == "cuda"
    if gguf is not None:
        return memory.gguf_dtype(config.dtype, gguf, config.kv_cache_memory, on_gpu, gguf.gguf.name)
    if not isinstance(model, torch.nn.Module):
        return memory.dtype_for(config.dtype, Path(model), config.kv_cache_memory, on_gpu)
    num_weights = sum(p.numel() for p in model.parameters())
    return memory.choose_dtype(config.dtype, num_weights, config.kv_cache_memory, memory.available_memory(),
                               memory.native_dtypes(), on_gpu, type(model).__name__)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no GPU; use --device cpu")
    return device


def _load(model: str | Path | torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    attention.register()
    if isinstance(model, torch.nn.Module):
        loaded = model
        loaded.set_attn_implementation(attention.ATTENTION_NAME)
    else:
        hf_logging.disable_progress_bar()
        try:
            with HF_LOAD_LOCK:
                loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                              attn_implementation=attention.ATTENTION_NAME)
        except KeyError as exc:
            if exc.args == (attention.ATTENTION_NAME,):  # the class looks attention up in a table of its own
                raise ModelError(f"cannot load model {model}: its transformers class does not take an attention "
                                 "function through transformers' attention interface, so bulkgen cannot plug its "
                                 "paged attention into it") from exc
            raise ModelError(f"cannot load model {model}: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load model {model}: {exc}") from exc
    return _checked(loaded).to(device=device, dtype=dtype).eval()


def _checked(loaded: torch.nn.Module) -> torch.nn.Module:
    """The model, where bulkgen's attention reaches it and it uses nothing bulkgen does not compute."""
    if loaded.config._attn_implementation != attention.ATTENTION_NAME:
        raise ModelError(f"{type(loaded).__name__} does not use transformers' attention interface; "
                         "bulkgen cannot plug its paged attention into it")
    missing = unsupported_features(loaded)
    if missing is not None:
        raise ModelError(f"{type(loaded).__name__} uses {missing}, which bulkgen does not compute "
                         "yet: it cannot run this model exactly")
    return loaded

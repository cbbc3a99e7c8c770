"""The model runner owns torch: it loads the model, holds the KV cache, and runs one step.

A step's scheduled tokens are flattened into one ragged batch (decodes first, then prefill chunks),
so the linear layers see no padding, and only the positions that need sampling reach the LM head.
The Llama family runs through our lean forward (forward.py); other models through their Hugging Face
modules with our attention plugged in.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import numpy as np
import psutil
import torch

from bulkgen.config import DTYPES, EngineConfig, format_size, parse_kernels
from bulkgen.engine import attention, cpu_paths, forward
from bulkgen.engine.cpu import check_dtype_fits
from bulkgen.engine.kernels import NO_KERNEL_ENV, load_cpu_kernels
from bulkgen.engine.scheduler import ScheduledSeq
from bulkgen.engine.sequence import Sequence
from bulkgen.errors import ConfigError, ModelError
from bulkgen.resolve import sliding_window

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES, as torch names them
CPU_DEFAULT_KV_BYTES = 4 * 2**30
MIN_KV_BLOCKS = 4
CPU_HEADROOM_BYTES = 1 * 2**30  # activations of a 1k-token step, Python, libraries


class ModelRunner:
    def __init__(self, model: str | Path | torch.nn.Module, config: EngineConfig) -> None:
        self.config = config
        self.device = _device(config.device)
        self.dtype = TORCH_DTYPES[config.dtype]
        if self.device.type == "cpu":
            check_dtype_fits(config.dtype)
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            _keep_freed_memory()
        self.model = _load(model, self.dtype, self.device)
        # Triton kernels for attention, the KV write and the small ops: on a GPU, or (tests) in Triton's CPU
        # interpreter when asked for
        self.use_triton = _use_triton(self.device, config.attention_backend)
        self.paths = self._choose_paths()
        self.kernel = self.paths.kernel
        if self.use_triton:
            from bulkgen.engine.triton_ops import TritonOps

            self.ops = TritonOps()
        else:
            self.ops = forward.Ops(self.paths.c("small_ops"), self.dtype, self.paths.c("sampler"))
        self.forward = forward.make_forward(self.model, self.paths, config.pack_weights, self.ops) \
            if config.fast_forward else None
        self.packed_linears = 0
        if self.forward is None and config.pack_weights and self.device.type == "cpu" and self.dtype != torch.float16:
            self.packed_linears = pack_linears(self.model)
        hf = self.model.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.block_size = config.block_size
        if self.use_triton and self.block_size < triton_min_block():
            raise ConfigError(f"the Triton kernels take KV blocks of at least {triton_min_block()} tokens (tensor-core "
                              f"tiles); got --block-size {self.block_size}")
        element = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * element
        budget = self._kv_budget()
        self.num_blocks = budget // (self.kv_bytes_per_token * self.block_size)
        # CUDA graphs pad decode steps with rows that write a scratch block no sequence owns (cuda_graphs.py)
        self.use_graphs = self._use_graphs()
        num_cache_blocks = self.num_blocks
        self.num_blocks -= self.use_graphs
        if self.num_blocks < MIN_KV_BLOCKS:
            raise ConfigError(f"a KV cache of {format_size(budget)} holds {self.num_blocks} blocks of "
                              f"{self.block_size} tokens ({self.kv_bytes_per_token} bytes a token): too small to run "
                              f"anything; give at least {MIN_KV_BLOCKS * self.block_size * self.kv_bytes_per_token} "
                              "bytes with --kv-cache-memory")
        # One allocation, never grown: [K|V, layer, block, kv_head, row, head_dim]. Head-major blocks keep
        # one head's part of a block contiguous, which is how decode attention reads them; for the CPU
        # kernels K is stored transposed within its block ([head_dim, row], dims in pairs for 2-byte types)
        # so that decode scores 16 tokens per vector (attention.k_block_shape); Triton reads K as V.
        shape = (self.num_layers, num_cache_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.kv_cache = _zeros_on_huge_pages((2, *shape), self.dtype, self.device)
        self.kv_cache_bytes = self.kv_cache.numel() * element
        k_shape = attention.k_block_shape(self.num_kv_heads, self.head_dim, self.block_size, self.dtype,
                                          transposed=not self.use_triton)
        self._k_caches = list(self.kv_cache[0].view(*shape[:2], *k_shape))
        self._v_caches = list(self.kv_cache[1])
        # Whether prefill attention runs in our C kernel (it reads each chunk's context from the blocks itself)
        self.prefill_in_c = self.paths.c("prefill_attention") is not None \
            and attention.kernel_layout(self._k_caches[0])
        self.decode_graphs = None  # built by limit_context, when graphs are on

    def limit_context(self, max_model_len: int) -> None:
        """The engine's cap on a sequence's tokens: decode graphs' block tables are that wide."""
        if self.use_graphs:
            from bulkgen.engine.cuda_graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                self.forward, self._k_caches, self._v_caches, scratch_block=self.num_blocks, block_size=self.block_size,
                max_blocks_per_seq=-(-max_model_len // self.block_size), max_num_seqs=self.config.max_num_seqs,
                num_kv_heads=self.num_kv_heads, device=self.device)

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
        return True

    @property
    def max_num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one step. Returns float32 logits [num_sampled, vocab] and the sequences they belong to:
        those whose computed tokens reach their known tokens this step."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for s in decodes:
            seq = s.seq
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        chunks: list[attention.PrefillChunk] = []
        for s in prefills:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            chunk = attention.PrefillChunk(offset=len(input_ids), num_tokens=n, start=start)
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            context_slots = _slots(seq.block_table, bs, 0, start + n)  # the chunk's and its context's
            slots.extend(context_slots[start:].tolist())
            if self.use_triton:
                chunk.block_table = seq.block_table  # a list: gpu_step packs it with the rest
            elif self.prefill_in_c:
                chunk.block_table = torch.tensor(seq.block_table, dtype=torch.int32)
            elif start:
                chunk.context_blocks = torch.from_numpy(context_slots // bs).to(self.device)
                chunk.context_offsets = torch.from_numpy(context_slots % bs).to(self.device)
                if start > n:  # else attention pads the queries instead (see attention.attend)
                    q_pos = torch.arange(start, start + n, device=self.device)
                    chunk.mask = q_pos[:, None] >= torch.arange(start + n, device=self.device)[None, :]
            chunks.append(chunk)
        offset = 0
        for s in decodes + prefills:
            offset += s.num_new_tokens
            if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens:
                sample_rows.append(offset - 1)
                sampled.append(s.seq)
        graphs = self.decode_graphs
        if graphs is not None and not prefills and graphs.bucket(len(decodes)) is not None \
                and all(len(s.seq.block_table) <= graphs.width for s in decodes):
            logits = graphs.run(input_ids, positions, slots, [s.seq.block_table for s in decodes],
                                [s.seq.num_computed_tokens + 1 for s in decodes])
            return (logits if len(sample_rows) == len(decodes) else logits[sample_rows]), sampled
        if self.use_triton:
            meta, ids, pos, keep = self._triton_inputs(decodes, input_ids, positions, sample_rows, slots, chunks)
        else:
            meta = self._metadata(decodes, slots, chunks)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            keep = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        if self.forward is not None:
            return self.forward(ids, pos, keep, meta).float(), sampled
        with attention.step(meta):
            output = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep)
        return output.logits[0].float(), sampled

    def _triton_inputs(self, decodes: list[ScheduledSeq], input_ids: list[int], positions: list[int],
                       sample_rows: list[int], slots: list[int], chunks: list[attention.PrefillChunk],
                       ) -> tuple[attention.AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's inputs and attention metadata in one copy to the device (gpu_step.py)."""
        from bulkgen.engine.gpu_step import triton_step

        group = self.model.config.num_attention_heads // self.num_kv_heads
        step, ids, pos, keep = triton_step(input_ids, positions, sample_rows, slots,
                                           [s.seq.block_table for s in decodes],
                                           [s.seq.num_computed_tokens + 1 for s in decodes],
                                           [(c.offset, c.num_tokens, c.start, c.block_table) for c in chunks],
                                           self.device, self.num_kv_heads, group)
        meta = attention.AttentionMetadata(self._k_caches, self._v_caches, step.slots, step.slots, step.slots,
                                           len(decodes), step.decode_block_tables, step.decode_context_lens, 0,
                                           triton=step)
        return meta, ids, pos, keep

    def _metadata(self, decodes: list[ScheduledSeq], slots: list[int],
                  chunks: list[attention.PrefillChunk]) -> attention.AttentionMetadata:
        num_decodes = len(decodes)
        max_blocks = max((len(s.seq.block_table) for s in decodes), default=0)
        tables = np.zeros((num_decodes, max_blocks), dtype=np.int32)
        for i, s in enumerate(decodes):
            tables[i, :len(s.seq.block_table)] = s.seq.block_table
        context_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=self.device)
        return attention.AttentionMetadata(
            k_caches=self._k_caches, v_caches=self._v_caches, slots=slot_tensor,
            slot_blocks=slot_tensor // self.block_size, slot_offsets=slot_tensor % self.block_size,
            num_decode_tokens=num_decodes,
            decode_block_tables=torch.from_numpy(tables).to(self.device),
            decode_context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            decode_max_context_len=max(context_lens, default=0),
            prefills=chunks, decode_kernel=self.paths.c("decode_attention"),
            prefill_kernel=self.paths.c("prefill_attention"), write_kernel=self.paths.c("small_ops"),
            num_threads=torch.get_num_threads(),
        )

    def _choose_paths(self) -> cpu_paths.CpuPaths:
        """C kernels or torch, per kernel family (cpu_paths.py): forced by the config or BULKGEN_KERNELS, else
        measured on this machine. Logged at INFO (`bulkgen run -v`)."""
        config = self.config
        if self.device.type != "cpu":
            return cpu_paths.CpuPaths.torch_only(f"not on a CPU ({self.device})")
        if self.use_triton:
            return cpu_paths.CpuPaths.torch_only("Triton kernels in the interpreter (--attention-backend triton)")
        if config.attention_backend == "torch":
            paths = cpu_paths.CpuPaths.torch_only("forced by --attention-backend torch")
        else:
            spec, forced_by = config.kernels, f"--kernels {config.kernels}"
            if spec == "auto" and os.environ.get(cpu_paths.KERNELS_ENV):
                spec = os.environ[cpu_paths.KERNELS_ENV]
                forced_by = f"{cpu_paths.KERNELS_ENV}={spec}"
            forced = parse_kernels(spec)
            if config.attention_backend == "kernel":
                forced.update(decode_attention="c", prefill_attention="c")
                forced_by = "--attention-backend kernel" if spec == "auto" else f"{forced_by} --attention-backend kernel"
            if len(forced) == len(cpu_paths.KERNEL_FAMILIES) and "c" not in forced.values():
                return cpu_paths.CpuPaths.torch_only(f"forced by {forced_by}")
            kernel = load_cpu_kernels()
            no_kernel = f"{NO_KERNEL_ENV} is set" if os.environ.get(NO_KERNEL_ENV) \
                else "the C kernels could not be built or loaded here (see the warning above)"
            paths = cpu_paths.choose(kernel, self.dtype, cpu_paths.model_shape(self.model, config), forced, forced_by,
                                     no_kernel)
        log.info("bulkgen: %s; kernel paths%s:", cpu_paths.describe_machine(self.dtype),
                 f" ({paths.note})" if paths.note else "")
        for line in paths.lines():
            log.info("  %s", line)
        return paths

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory is not None:
            if self.device.type == "cpu":
                available = psutil.virtual_memory().available
                if self.config.kv_cache_memory > available - CPU_HEADROOM_BYTES:
                    raise ConfigError(
                        f"a KV cache of {format_size(self.config.kv_cache_memory)} does not fit: with the model "
                        f"loaded, {format_size(available)} of memory is free, and activations need about "
                        f"{format_size(CPU_HEADROOM_BYTES)} more; lower --kv-cache-memory")
            return self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free  # weights (already loaded) and other processes
            activations = 2 * 2**30
            budget = int(total * self.config.gpu_memory_utilization) - used_elsewhere - activations
            if budget <= 0:
                raise ConfigError(f"no GPU memory left for a KV cache: {format_size(used_elsewhere)} of "
                                  f"{format_size(total)} in use; raise --gpu-memory-utilization or free the GPU")
            return budget
        available = psutil.virtual_memory().available
        return int(min(CPU_DEFAULT_KV_BYTES, available * 0.25))


class PackedLinear(torch.nn.Module):
    """A linear layer whose weight oneDNN has reordered once into its blocked layout: on CPU its GEMMs
    run about a third faster than the same nn.Linear (200 vs 150 GFLOP/s in float32 on 2 cores at 64
    rows, 400 vs 270 in bfloat16), with results equal up to the order of the float additions."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                                         requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every nn.Linear of the model for a PackedLinear (CPU only). Returns how many were swapped;
    0 where this torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor which, on CPU, asks Linux for 2 MiB pages before its memory is first touched: decode
    attention reads each sequence's blocks scattered across the whole cache, and with 4 KiB pages
    nearly every block costs a TLB miss."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        huge = 2 * 2**20
        start = -(-tensor.data_ptr() // huge) * huge
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // huge * huge
        if end > start:
            try:
                libc = ctypes.CDLL("libc.so.6", use_errno=True)
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE
            except OSError:
                pass
    return tensor.zero_()


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed activation buffers (up to 32 MiB each) on its heap instead of returning
    them to the kernel: otherwise every step maps them afresh and pays a page fault per 4 KiB, which cost
    a tenth of a prefill step here."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: its maximum on 64-bit
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD


def _slots(block_table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots of positions [start, end): block_table[p // block_size] * block_size + p % block_size.

        positions   0 1 2 3 | 4 5 6 7 | 8 9        (block_size 4)
        block_table [  7    ,    2    ,  5 ]
        slots       28 .. 31| 8 .. 11 | 20 21
    """
    positions = np.arange(start, end)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def triton_min_block() -> int:
    from bulkgen.engine.triton_attention import MIN_DOT

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
            loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                          attn_implementation=attention.ATTENTION_NAME)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot load model {model}: {exc}") from exc
    if loaded.config._attn_implementation != attention.ATTENTION_NAME:
        raise ModelError(f"{type(loaded).__name__} does not use transformers' attention interface; "
                         "bulkgen cannot plug its paged attention into it")
    missing = attention.unsupported_features(loaded)
    if missing is not None:
        raise ModelError(f"{type(loaded).__name__} uses {missing}, which bulkgen does not compute "
                         "yet: it cannot run this model exactly")
    window = sliding_window(loaded.config)
    if window is not None:
        log.warning("bulkgen: %s attends over a sliding window of %s tokens in some layers, which bulkgen does "
                    "not run yet: requests longer than the window are refused (each fails with that reason)",
                    type(loaded).__name__, window)
    return loaded.to(device=device, dtype=dtype).eval()

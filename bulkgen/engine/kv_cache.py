"""The paged KV cache: sized from a byte budget (`--kv-cache-memory`, or a share of the memory that is
free), allocated once and never grown (invariant 2).

    kv      [K|V, place, block, kv_head, row, head_dim]

A block holds its tokens for each layer of one group (block_manager.KVLayout: for a model whose layers all
attend alike, every layer; else `group_size` layers of one kind), a layer at its place within the group.

Head-major blocks keep one head's part of a block contiguous, which is how decode attention reads them;
for the CPU kernels K is stored transposed within its block ([head_dim, row], dims in pairs for 2-byte
types) so that decode scores 16 tokens per vector (k_block_shape); Triton reads K as V.
"""

from __future__ import annotations

import ctypes

import torch

from bulkgen.config import EngineConfig, format_size
from bulkgen.engine.block_manager import KVLayout
from bulkgen.engine.memory import CPU_HEADROOM_BYTES, available_memory
from bulkgen.engine.metadata import k_block_shape
from bulkgen.errors import ConfigError
from bulkgen.model import ModelShape

CPU_DEFAULT_KV_BYTES = 4 * 2**30
GPU_ACTIVATION_BYTES = 2 * 2**30
MIN_KV_BLOCKS = 4


class KVCache:
    """K and V of every layer in blocks of block_size tokens, laid out by `layout`; past the blocks sequences may
    hold, the null block (where the layout slides: named by a sliding group's table for a block given back, kept
    zero) and `num_scratch_blocks` more that no sequence owns (CUDA graphs pad decode steps with rows that write
    there)."""

    def __init__(self, shape: ModelShape, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 num_scratch_blocks: int, transposed_k: bool, layout: KVLayout | None = None,
                 max_context: int | None = None) -> None:
        """max_context: the longest sequence the engine runs; where given, a CPU's default budget is no more
        than max_num_seqs such sequences need (a small model's 4 GiB would be mostly never touched, and zeroing
        it alone takes seconds)."""
        self.block_size = block_size = config.block_size
        self.layout = layout = layout or KVLayout.of(shape.num_layers)
        self.bytes_per_token = shape.kv_bytes_per_token(config.dtype)  # every layer's
        block_bytes = self.bytes_per_token * layout.group_size // shape.num_layers * block_size
        budget = kv_budget(config, device)
        if config.kv_cache_memory is None and device.type == "cpu" and max_context is not None:
            blocks_per_seq = -(-max_context // block_size) * layout.num_groups
            spare = MIN_KV_BLOCKS * layout.num_groups + num_scratch_blocks + int(layout.slides)
            budget = min(budget, (config.max_num_seqs * blocks_per_seq + spare) * block_bytes)
        num_cache_blocks = budget // block_bytes
        self.null_block = num_cache_blocks - num_scratch_blocks - int(layout.slides)
        self.num_blocks = self.null_block  # what sequences may hold
        self.scratch_block = self.null_block + int(layout.slides)
        least = MIN_KV_BLOCKS * layout.num_groups
        if self.num_blocks < least:
            need = (least + num_scratch_blocks + 1) * block_bytes
            flag = f"{-(-need // 2**20)}MiB" if need > 2**20 else f"{-(-need // 2**10)}KiB"  # rounded up
            raise ConfigError(f"a KV cache of {format_size(budget)} holds {max(self.num_blocks, 0)} blocks of "
                              f"{block_size} tokens ({format_size(block_bytes)} a block): too small to run anything; "
                              f"give --kv-cache-memory {flag} or more")
        places = (layout.group_size, num_cache_blocks, shape.num_kv_heads, block_size, shape.head_dim)
        self.tensor = zeros_on_huge_pages((2, *places), dtype, device)
        self.num_bytes = self.tensor.numel() * self.tensor.element_size()
        k_block = k_block_shape(shape.num_kv_heads, shape.head_dim, block_size, dtype,
                                          transposed=transposed_k)
        k_places = self.tensor[0].view(*places[:2], *k_block)
        self.k_caches = [k_places[place] for place in layout.layer_places]  # one a layer
        self.v_caches = [self.tensor[1][place] for place in layout.layer_places]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Each (source, destination): the destination block becomes a copy of the source, K and V of every layer
        (block_manager: a partly shared prefix). Sources are read before any destination is written."""
        if copies:
            source, destination = (torch.tensor(ids, device=self.tensor.device) for ids in zip(*copies, strict=True))
            self.tensor[:, :, destination] = self.tensor[:, :, source]

    @property
    def max_num_tokens(self) -> int:
        """Tokens of context the cache holds for every layer that attends to the whole context (all layers'
        where all slide)."""
        return self.num_blocks * self.block_size // max(self.layout.num_full_groups, 1)


def kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes for K and V: the configured size (checked against free memory on a CPU), else what the GPU's
    memory share leaves after the weights, else a quarter of free memory up to 4 GiB."""
    if config.kv_cache_memory is not None:
        if device.type == "cpu":
            available = available_memory()
            if config.kv_cache_memory > available - CPU_HEADROOM_BYTES:
                raise ConfigError(
                    f"a KV cache of {format_size(config.kv_cache_memory)} does not fit: with the model "
                    f"loaded, {format_size(available)} of memory is free, and activations need about "
                    f"{format_size(CPU_HEADROOM_BYTES)} more; lower --kv-cache-memory")
        return config.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free  # weights (already loaded) and other processes
        budget = int(total * config.gpu_memory_utilization) - used_elsewhere - GPU_ACTIVATION_BYTES
        if budget <= 0:
            raise ConfigError(f"no GPU memory left for a KV cache: {format_size(used_elsewhere)} of "
                              f"{format_size(total)} in use; raise --gpu-memory-utilization or free the GPU")
        return budget
    return int(min(CPU_DEFAULT_KV_BYTES, available_memory() * 0.25))


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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

"""The paged KV cache: sized from a byte budget (`--kv-cache-memory`, or a share of the memory that is
free), allocated once and never grown (invariant 2).

    kv      [K|V, layer, block, kv_head, row, head_dim]

Head-major blocks keep one head's part of a block contiguous, which is how decode attention reads them;
for the CPU kernels K is stored transposed within its block ([head_dim, row], dims in pairs for 2-byte
types) so that decode scores 16 tokens per vector (attention.k_block_shape); Triton reads K as V.
"""

from __future__ import annotations

import ctypes

import torch

from bulkgen.config import EngineConfig, format_size
from bulkgen.engine import attention
from bulkgen.engine.memory import CPU_HEADROOM_BYTES, available_memory
from bulkgen.errors import ConfigError
from bulkgen.model import ModelShape

CPU_DEFAULT_KV_BYTES = 4 * 2**30
GPU_ACTIVATION_BYTES = 2 * 2**30
MIN_KV_BLOCKS = 4


class KVCache:
    """K and V of every layer in blocks of block_size tokens; `num_scratch_blocks` more that no sequence
    owns (CUDA graphs pad decode steps with rows that write there)."""

    def __init__(self, shape: ModelShape, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 num_scratch_blocks: int, transposed_k: bool) -> None:
        self.block_size = block_size = config.block_size
        self.bytes_per_token = shape.kv_bytes_per_token(config.dtype)
        budget = kv_budget(config, device)
        num_cache_blocks = budget // (self.bytes_per_token * block_size)
        self.num_blocks = num_cache_blocks - num_scratch_blocks  # what sequences may hold
        if self.num_blocks < MIN_KV_BLOCKS:
            raise ConfigError(f"a KV cache of {format_size(budget)} holds {self.num_blocks} blocks of "
                              f"{block_size} tokens ({self.bytes_per_token} bytes a token): too small to run "
                              f"anything; give at least {MIN_KV_BLOCKS * block_size * self.bytes_per_token} "
                              "bytes with --kv-cache-memory")
        layers = (shape.num_layers, num_cache_blocks, shape.num_kv_heads, block_size, shape.head_dim)
        self.tensor = zeros_on_huge_pages((2, *layers), dtype, device)
        self.num_bytes = self.tensor.numel() * self.tensor.element_size()
        k_block = attention.k_block_shape(shape.num_kv_heads, shape.head_dim, block_size, dtype,
                                          transposed=transposed_k)
        self.k_caches = list(self.tensor[0].view(*layers[:2], *k_block))  # one a layer
        self.v_caches = list(self.tensor[1])

    @property
    def max_num_tokens(self) -> int:
        return self.num_blocks * self.block_size


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

# Whole (over 300 lines): a ragged batch's metadata and the attention paths that read it change together; the C and
# Triton kernels live in cpu/ and gpu/.
"""Paged attention plugged into Hugging Face models through transformers' attention-function interface.

The runner flattens every scheduled token of every sequence into one ragged batch (batch size 1,
no padding). The model computes q, k, v and RoPE as usual, then calls `attend` per layer (through
`paged_attention_forward` for Hugging Face modules, directly from `llama.LlamaForward`), which
writes the new K/V into the paged cache and attends:
- decode tokens (one new token per sequence, placed first in the batch) in one batched call over
  K/V read in place from their blocks: our C kernel on CPU (cpu/attention.py), a gather + SDPA in torch elsewhere;
- prefill chunks one sequence at a time: on CPU through the same C kernel, tiles of query rows as
  decodes over the chunk's blocks, causal by context length; elsewhere with SDPA, causal over
  the chunk itself or, when earlier tokens are already cached (chunked prefill, prefix cache,
  recompute), over K/V gathered from blocks.
Each layer attends as the model says (LayerAttention): over the whole context or a sliding window of its
last tokens, with its scores softcapped or a sink logit per head where the model has them; every path
(C, torch, Triton) computes all of it, so that a model runs as its own masks define it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bulkgen.engine.cpu.attention import decode_c, kernel_layout, prefill_c
from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.errors import ModelError

ATTENTION_NAME = "bulkgen_paged"


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


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         layer: LayerAttention, is_causal: bool = False) -> torch.Tensor:
    """Attention in torch: q [B, heads, n, d], k and v [B, kv_heads, ctx, d], mask (bool, True: seen)
    broadcast to [B, heads, n, ctx] or None (is_causal: the causal mask). Torch's fused kernel where it
    computes the layer; else the same math written out (softcapping, sinks) as Hugging Face's eager
    attention computes it, the softmax in float32."""
    if layer.plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if layer.softcap:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if is_causal:
        mask = causal_mask(k.shape[2] - q.shape[2], q.shape[2], 0, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        sinks = layer.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    if layer.sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v)


def gather_k(k_cache: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keys at (block, row) pairs of a layer's K cache (either layout) -> [n, num_kv_heads, head_dim]."""
    if k_cache.dim() == 4:  # [blocks, kv_heads, block_size, head_dim]
        return k_cache[blocks, :, rows]
    k = k_cache[blocks, :, :, rows]  # [n, kv_heads, head_dim / P, P]
    return k.reshape(k.shape[0], k.shape[1], -1)


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


@dataclass(kw_only=True)
class AttentionMetadata:
    """What every layer's attention needs for one step (built once per step by the runner, by keyword: each
    backend sets what it reads)."""

    k_caches: list[torch.Tensor]  # per layer: [num_blocks, *k_block_shape(...)] (K transposed in its block)
    v_caches: list[torch.Tensor]  # per layer: [num_blocks, num_kv_heads, block_size, head_dim]
    slots: torch.Tensor  # [num_tokens] int64: block * block_size + row of each new token's K/V
    slot_blocks: torch.Tensor  # [num_tokens] int64: the block of each new token's K/V
    slot_offsets: torch.Tensor  # [num_tokens] int64: its row within the block
    num_decode_tokens: int  # the first tokens of the batch, one per decoding sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] (int32 for the kernel)
    decode_context_lens: torch.Tensor  # [num_decodes] int32, tokens to attend to (the new one included)
    decode_max_context_len: int
    prefills: list[PrefillChunk] = field(default_factory=list)
    windows: tuple[int, ...] = ()  # per layer: its sliding window (0, or none given: the whole context)
    calls: list[int] | None = None  # the layers whose attention came through paged_attention_forward (a probe)
    mask_windows: dict[int, int] | None = None  # per layer, the window its own mask gives (a probe: MaskSpan)
    # The C kernels for decode attention, prefill attention and the KV write (None: torch); each family's
    # path is chosen per machine (cpu/paths.py)
    decode_kernel: Kernels | None = None
    prefill_kernel: Kernels | None = None
    write_kernel: Kernels | None = None
    num_threads: int = 1
    triton: TritonStep | None = None  # set where attention and the KV write run in Triton (a GPU)
    # Where layers hold their K/V in groups (block_manager.KVLayout): each group's slots and block tables, and each
    # layer's group; a layer's attention reads its own group's metadata
    groups: list[AttentionMetadata] | None = None
    layer_groups: tuple[int, ...] = ()


@dataclass
class TritonStep:
    """The Triton kernels' view of a step, int32 tensors on the device (runner: one copy from the host)."""

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


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query [1, num_heads, num_tokens, head_dim], key and
    value [1, num_kv_heads, num_tokens, head_dim]; returns [1, num_tokens, num_heads, head_dim]."""
    meta = getattr(_STEP, "meta", None)
    if meta is None:
        raise ModelError(f"{type(module).__name__} was called outside a bulkgen step")
    layer = module.layer_idx
    window = meta.windows[layer] if meta.windows else 0
    if isinstance(attention_mask, MaskSpan):  # the runner's probe: the layer's own mask says
        window = attention_mask.window
        if meta.mask_windows is not None:
            meta.mask_windows[layer] = window
    _check_module(module, layer, key, value, meta, kwargs, window)
    sinks = kwargs.get("s_aux")
    spec = LayerAttention(window=window, softcap=float(kwargs.get("softcap") or 0.0),
                          sinks=None if sinks is None else sinks.detach().float().contiguous())
    scale = scaling if scaling is not None else query.shape[-1]**-0.5
    out = attend(meta, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale,
                 spec)
    return out.unsqueeze(0), None


def _check_module(module: torch.nn.Module, layer: int, key: torch.Tensor, value: torch.Tensor,
                  meta: AttentionMetadata, kwargs: dict, window: int) -> None:
    """What a Hugging Face module asks of its attention that bulkgen's does not compute: refused (ModelError), never
    run to other outputs. The runner's probe at load meets these first, before any request."""
    name = type(module).__name__
    causal = kwargs.get("is_causal")
    if (getattr(module, "is_causal", True) if causal is None else causal) is False:
        raise ModelError(f"{name} attends in both directions (an encoder's attention, not a causal LM's): bulkgen "
                         "generates with causal attention only")
    cache = meta.v_caches[layer]
    if key.shape[1] != cache.shape[1] or key.shape[-1] != cache.shape[-1] or value.shape[-1] != cache.shape[-1]:
        raise ModelError(f"{name} (layer {layer}) gives K/V of {key.shape[1]} heads x {key.shape[-1]} dims (V "
                         f"{value.shape[-1]}) where its config reads {cache.shape[1]} x {cache.shape[-1]}: bulkgen's "
                         "KV cache cannot hold them")
    asked = kwargs.get("sliding_window")
    # None: the module leaves the window to its mask (read at load: the runner's probe)
    if asked is not None and asked != window:
        raise ModelError(f"{name} (layer {layer}) asks its attention for a sliding window of {asked}, where its mask "
                         f"gives {window or 'none'}: bulkgen cannot tell which the model means")
    if meta.calls is not None:
        meta.calls.append(layer)


def attend(meta: AttentionMetadata, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float, spec: LayerAttention | None = None) -> torch.Tensor:
    """One layer's attention for a step: query [num_tokens, num_heads, head_dim], key and value
    [num_tokens, num_kv_heads, head_dim] (the step's new tokens, decodes first). Writes key and value
    into the paged cache, returns [num_tokens, num_heads, head_dim]. spec: the layer's attention (None:
    its window from meta.windows, nothing else)."""
    if spec is None:
        spec = LayerAttention(window=meta.windows[layer]) if meta.windows and meta.windows[layer] else FULL
    if meta.layer_groups:
        meta = meta.groups[meta.layer_groups[layer]]
    k_cache, v_cache = meta.k_caches[layer], meta.v_caches[layer]
    if meta.triton is not None:
        return _attend_triton(meta.triton, query, key, value, k_cache, v_cache, scale, spec)
    num_tokens, num_heads, head_dim = query.shape
    write_kv(meta, key, value, k_cache, v_cache)

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        q = query[:num_decodes]  # [num_decodes, num_heads, head_dim]
        if meta.decode_kernel is not None and kernel_layout(k_cache):
            out[:num_decodes] = decode_c(meta, q, k_cache, v_cache, scale, spec)
        else:
            out[:num_decodes] = decode_torch(q, k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_context_lens, scale, spec)
    for chunk in meta.prefills:
        span = slice(chunk.offset, chunk.offset + chunk.num_tokens)
        if meta.prefill_kernel is not None and chunk.block_table is not None and kernel_layout(k_cache):
            # The query rows as decodes over the sequence's blocks (its K/V were just written), causal by
            # context length, in tiles of 4 rows (1.4-1.8x torch's flash kernel in float32 on AVX-512 CPUs;
            # whether it runs on this one is measured, cpu/paths.py).
            out[span] = prefill_c(meta, query[span], k_cache, v_cache, chunk, scale, spec)
            continue
        q = query[span].transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]: 4-D takes torch's fused kernel
        # the window matters only where a row sees more than it
        window = spec.window if spec.window and chunk.start + chunk.num_tokens > spec.window else 0
        if chunk.context_blocks is None:
            k = key[span].transpose(0, 1).unsqueeze(0)
            v = value[span].transpose(0, 1).unsqueeze(0)
        else:
            # [ctx, kv_heads, d] gathered from the blocks -> [1, kv_heads, ctx, d]
            k = gather_k(k_cache, chunk.context_blocks, chunk.context_offsets).transpose(0, 1).unsqueeze(0)
            v = v_cache[chunk.context_blocks, :, chunk.context_offsets].transpose(0, 1).unsqueeze(0)
        if window or not spec.plain:
            o = sdpa(q, k, v, chunk.mask_for(window, q.device), scale, spec)
        elif chunk.context_blocks is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            if chunk.mask is None:
                # A short cached start (a prefix-cache hit): pad the queries in front so that torch's causal
                # kernel (top-left aligned) lines up with the chunk's positions; twice as fast as a mask.
                padded = q.new_zeros(1, num_heads, chunk.start + chunk.num_tokens, head_dim)
                padded[:, :, chunk.start:] = q
                o = F.scaled_dot_product_attention(padded, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=True)[:, :, chunk.start:]
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[span] = o[0].transpose(0, 1)
    return out


def write_kv(meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> None:
    """Store the step's new keys and values ([num_tokens, num_kv_heads, head_dim] each) in their slots."""
    kernel = meta.write_kernel
    if kernel is not None and kernel_layout(k_cache) and key.stride(-1) == 1 and value.stride(-1) == 1:
        num_tokens, num_kv_heads, head_dim = key.shape
        function = kernel.write_kv_4 if key.element_size() == 4 else kernel.write_kv_2
        function(key=key.data_ptr(), value=value.data_ptr(), k_token_stride=key.stride(0),
                 k_head_stride=key.stride(1), v_token_stride=value.stride(0), v_head_stride=value.stride(1),
                 slots=meta.slots.data_ptr(), num_tokens=num_tokens, k_cache=k_cache.data_ptr(),
                 v_cache=v_cache.data_ptr(), num_kv_heads=num_kv_heads, head_dim=head_dim,
                 block_size=v_cache.shape[2], num_threads=meta.num_threads)
        return
    if k_cache.dim() == 4:
        k_cache[meta.slot_blocks, :, meta.slot_offsets] = key
    else:
        k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = key.reshape(*key.shape[:2], -1, k_cache.shape[-1])
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = value


def _attend_triton(step: TritonStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, spec: LayerAttention) -> torch.Tensor:
    """The step's KV write, decode and prefill attention in three launches (gpu/attention.py)."""
    from bulkgen.engine.gpu import attention as triton_attention  # here: triton is optional

    triton_attention.write_kv(key, value, step.slots, k_cache, v_cache)
    # the kernels read a token's heads one after the other, its rows any stride apart (rows_of_heads: a transposed
    # query, as gpt-oss's RoPE makes, is copied once here); `out` is contiguous, whatever the query's strides
    query = triton_attention.rows_of_heads(query)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_decodes = step.decode_context_lens.shape[0]
    if num_decodes:  # into the step's output rows: no copy
        triton_attention.decode(query[:num_decodes], k_cache, v_cache, step.decode_block_tables,
                                step.decode_context_lens, scale, step.decode_splits, spec, out=out[:num_decodes],
                                params=step.decode_params)
    triton_attention.prefill(query, k_cache, v_cache, out, step.tile_chunks, step.tile_rows,  # none without chunks
                             step.chunk_offsets, step.chunk_lens, step.chunk_starts, step.chunk_block_tables, scale,
                             spec)
    return out


def decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, spec: LayerAttention = FULL) -> torch.Tensor:
    """Reference decode attention in plain torch: gathers each sequence's blocks, then one masked SDPA."""
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, block_size, head_dim = v_cache.shape
    index = block_tables.long()
    if k_cache.dim() == 4:  # [blocks, kv_heads, block_size, head_dim], as V
        k = k_cache[index].transpose(1, 2).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)
    else:  # [seqs, blocks, kv_heads, d / P, block_size, P] -> [seqs, kv_heads, blocks * block_size, d]
        k = k_cache[index].permute(0, 2, 1, 4, 3, 5).reshape(num_seqs, num_kv_heads, max_blocks * block_size,
                                                              head_dim)
    v = v_cache[index].transpose(1, 2).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)
    positions = torch.arange(max_blocks * block_size, device=q.device)[None, :]
    lens = context_lens[:, None].to(q.device)
    mask = positions < lens
    if spec.window:
        mask &= positions >= lens - spec.window
    o = sdpa(q.unsqueeze(2), k, v, mask[:, None, None, :], scale, spec)  # mask [seqs, 1, 1, ctx]
    return o[:, :, 0]  # [num_seqs, num_heads, head_dim]


@dataclass(frozen=True)
class MaskSpan:
    """What a layer's own mask lets a query see, as the model's code builds it (read by `mask_span` while the
    runner probes the model): the last `window` positions up to its own (0: all of them)."""

    window: int


def mask_span(batch_size: int, cache_position: torch.Tensor | None = None, kv_length: int = 0, kv_offset: int = 0,
              mask_function: object = None, attention_mask: torch.Tensor | None = None, **kwargs) -> object:
    """transformers' mask interface, registered only while the runner probes a model at load: instead of a
    mask, the span its mask function gives a query far into a sequence, which then reaches each layer's
    attention call as its attention_mask. So each layer's window is read from what the model's own code
    builds, not from a guess at what its config means. A mask that is not a causal window (bidirectional,
    chunked) is refused."""
    far = _PROBE_POSITION
    kv = torch.arange(far + 2)
    seen = mask_function(torch.tensor(0), torch.tensor(0), torch.tensor(far), kv)
    seen = torch.as_tensor(seen, dtype=torch.bool).expand(kv.shape)
    if bool(seen[far + 1]):
        raise ModelError("the model's mask lets a token see the tokens after it (an encoder's or a prefix-LM's "
                         "attention): bulkgen generates with causal attention only")
    first = int(seen[:far + 1].nonzero()[0]) if bool(seen[:far + 1].any()) else far + 1
    if first > far or not bool(seen[first:far + 1].all()):
        raise ModelError("the model's mask is not a causal window over the last tokens (chunked attention, say): "
                         "bulkgen's attention computes full and sliding-window attention only")
    return MaskSpan(window=0 if first == 0 else far - first + 1)


_PROBE_POSITION = 2**20  # a window of a million tokens or more reads as the whole context


@contextmanager
def reading_masks() -> Iterator[None]:
    """While the runner probes a model: transformers builds each mask through `mask_span` (MaskSpan values)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionMaskInterface.register(ATTENTION_NAME, mask_span)
    try:
        yield
    finally:  # unregistered, transformers builds no mask for bulkgen's attention (it needs none)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)


# The step's metadata, set by the runner around the model's forward on its own thread: not passed as a keyword
# argument through the model, since some families' layers do not hand those on to the attention (StableLM's).
_STEP = threading.local()


@contextmanager
def step(meta: AttentionMetadata) -> Iterator[None]:
    _STEP.meta = meta
    try:
        yield
    finally:
        _STEP.meta = None


def register() -> None:
    """Make `attn_implementation="bulkgen_paged"` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)

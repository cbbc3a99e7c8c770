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

import torch
import torch.nn.functional as F

from bulkgen.engine.cpu.attention import decode_c, kernel_layout, prefill_c
from bulkgen.engine.metadata import (
    ATTENTION_NAME,
    FULL,
    AttentionMetadata,
    CpuMetadata,
    LayerAttention,
    MaskSpan,
    TritonMetadata,
    causal_mask,
)
from bulkgen.errors import ModelError


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
        if meta.probe is not None:
            meta.probe.windows[layer] = window
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
    if meta.probe is not None:
        meta.probe.calls.append(layer)


def attend(meta: AttentionMetadata, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float, spec: LayerAttention | None = None) -> torch.Tensor:
    """One layer's attention for a step: query [num_tokens, num_heads, head_dim], key and value
    [num_tokens, num_kv_heads, head_dim] (the step's new tokens, decodes first). Writes key and value
    into the paged cache, returns [num_tokens, num_heads, head_dim]. spec: the layer's attention (None:
    its window from meta.windows, nothing else)."""
    if spec is None:
        spec = LayerAttention(window=meta.windows[layer]) if meta.windows and meta.windows[layer] else FULL
    meta = meta.for_layer(layer)
    k_cache, v_cache = meta.k_caches[layer], meta.v_caches[layer]
    if isinstance(meta, TritonMetadata):
        return _attend_triton(meta, query, key, value, k_cache, v_cache, scale, spec)
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
            # whether it runs on this one is measured, paths.py).
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


def write_kv(meta: CpuMetadata, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
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


def _attend_triton(step: TritonMetadata, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
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

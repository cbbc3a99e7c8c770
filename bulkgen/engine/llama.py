"""A lean forward pass for the Llama family (Llama, Mistral, Qwen2; SmolLM2 is a Llama).

The same math as Hugging Face's modules, on their weights, in the same order of operations, but
without the module machinery: a decode step of a small model spends as much time in Python as in
its GEMMs otherwise (30 layers × 9 modules × kwargs plumbing: about 9 ms a step for SmolLM2-135M).
Also: q, k, v are one GEMM and gate, up are one GEMM (fused weights, 7 GEMMs a layer become 4),
with SiLU-and-multiply applied as that GEMM's epilogue on CPU; RMSNorm and the residual add before it
run as one C pass; the final
norm and the LM head see only the rows that are sampled.

Models outside the family (or with features this does not reproduce: q/k norms, biases on o_proj or
the MLP, other activations) run through Hugging Face's modules with our attention plugged into
transformers' attention interface, which is exact for any model that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bulkgen.engine import attention, blocks
from bulkgen.engine.blocks import GGUFLinear
from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.cpu.machine import release_freed_memory
from bulkgen.engine.layers import GatedLinear, Linear, fused, rotate
from bulkgen.engine.metadata import AttentionMetadata
from bulkgen.engine.quant import Int8GatedLinear, QuantizedLinear, SiluMulAfter, int8_linear

FAMILY = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the lean forward cannot run this model (None: it can)."""
    name = type(model).__name__
    if name not in FAMILY:
        return f"{name} is not in the Llama family"
    config = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return "q/k norms"
    if attn.o_proj.bias is not None or any(getattr(mlp, n).bias is not None
                                           for n in ("gate_proj", "up_proj", "down_proj")):
        return "biases on o_proj or the MLP"
    if not all(type(getattr(attn, n)) in (torch.nn.Linear, GGUFLinear, QuantizedLinear)
               for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "non-standard projections"
    return None


class _Layer:
    def __init__(self, layer: torch.nn.Module, pack: bool, linear_kernel: Kernels | None,
                 gated_kernel: Kernels | None, ops: Any, int8: bool, int8_kernel: Kernels | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        if isinstance(attn.q_proj, GGUFLinear):  # --quantization gguf (blocks.py): the file's own blocks
            self.qkv = blocks.fused(attn.q_proj, attn.k_proj, attn.v_proj)
            self.o = attn.o_proj.linear
            self.mlp_in = SiluMulAfter(blocks.fused(mlp.gate_proj, mlp.up_proj), ops)
            self.down = mlp.down_proj.linear
        elif int8:  # --quantization int8 (quant.py)
            self.qkv: Any = int8_linear(attn.q_proj, attn.k_proj, attn.v_proj, kernel=int8_kernel)
            self.o: Any = int8_linear(attn.o_proj, kernel=int8_kernel)
            self.mlp_in: Any = Int8GatedLinear(mlp.gate_proj, mlp.up_proj, ops, int8_kernel)
            self.down: Any = int8_linear(mlp.down_proj, kernel=int8_kernel)
        else:
            self.qkv = fused(attn.q_proj, attn.k_proj, attn.v_proj, pack=pack, kernel=linear_kernel)
            self.o = Linear(attn.o_proj.weight.detach(), None, pack, linear_kernel)
            self.mlp_in = GatedLinear(mlp.gate_proj, mlp.up_proj, pack, gated_kernel, ops)
            self.down = Linear(mlp.down_proj.weight.detach(), None, pack, linear_kernel)
        self.input_norm = layer.input_layernorm.weight.detach()
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        self.eps = layer.input_layernorm.variance_epsilon
        self.scale = attn.scaling
        self.head_dim = attn.head_dim
        # The weights now live here only: drop the module's copies (the model is the runner's own).
        for owner, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                delattr(owner, name)


class LlamaForward:
    """forward(input_ids [T], positions [T], keep [K], meta) -> logits [K, vocab] in the model's dtype.
    The linear layers and the gated MLP input run in C where given their kernels (None: torch or oneDNN);
    `ops` are the small ops (cpu/ops.Ops, or gpu/ops.TritonOps on a GPU)."""

    def __init__(self, model: torch.nn.Module, ops: Any, pack: bool, linear_kernel: Kernels | None = None,
                 gated_kernel: Kernels | None = None, int8: bool = False, int8_kernel: Kernels | None = None) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight.detach()
        self.final_eps = inner.norm.variance_epsilon
        self.ops = ops
        self.layers = []
        for layer in inner.layers:
            self.layers.append(_Layer(layer, pack, linear_kernel, gated_kernel, ops, int8, int8_kernel))
            release_freed_memory()  # the weights it replaced, now: the heap would keep them until the last layer
        head = model.lm_head
        self.lm_head = head.linear if isinstance(head, GGUFLinear) else Linear(
            head.weight.detach(), None if head.bias is None else head.bias.detach(), pack, linear_kernel)
        model.lm_head = torch.nn.Identity()  # its (packed) copy is ours now; tied embeddings keep theirs

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        ops = self.ops
        h = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[0], sin[0]
        num_tokens = h.shape[0]
        x = ops.add_rms_norm(h, None, self.layers[0].input_norm, self.layers[0].eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            rotated = ops.rope(qkv, (layer.q_size + layer.kv_size) // layer.head_dim, layer.head_dim, cos, sin)
            q, k, v = (t.view(num_tokens, -1, layer.head_dim)
                       for t in qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1))
            if rotated is None:
                q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            o = attention.attend(meta, i, q, k, v, layer.scale)
            x = ops.add_rms_norm(h, layer.o(o.view(num_tokens, -1)), layer.post_norm, layer.eps)
            down = layer.down(layer.mlp_in(x))
            if i + 1 < len(self.layers):
                x = ops.add_rms_norm(h, down, self.layers[i + 1].input_norm, self.layers[i + 1].eps)
            else:
                h.add_(down)
        x = ops.add_rms_norm(h[keep], None, self.final_norm, self.final_eps)
        return self.lm_head(x)


def make_forward(model: torch.nn.Module, ops: Any, pack: bool, linear_kernel: Kernels | None = None,
                 gated_kernel: Kernels | None = None, int8: bool = False,
                 int8_kernel: Kernels | None = None) -> Callable[..., torch.Tensor] | None:
    """The lean forward for this model, or None where it must run through Hugging Face's modules. int8: the
    layers' linear products in int8 (quant.py; the LM head stays in float), in C given int8_kernel."""
    if unsupported_reason(model) is not None:
        return None
    return LlamaForward(model, ops, pack, linear_kernel, gated_kernel, int8, int8_kernel)


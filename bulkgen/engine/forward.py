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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from bulkgen.engine import attention
from bulkgen.engine.kernels import Kernels

if TYPE_CHECKING:
    from bulkgen.engine.cpu_paths import CpuPaths

FAMILY = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


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
    if attn.o_proj.bias is not None or any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return "biases on o_proj or the MLP"
    if not all(type(getattr(attn, n)) is torch.nn.Linear for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "non-standard projections"
    return None


class Linear:
    """y = x W^T + b. On CPU, given the C kernels (`kernel`; whether to is measured per machine, see
    cpu_paths.py): float32, and bfloat16 where the CPU has AVX512-BF16, through our C GEMM (weights packed
    once into its panels; 1.3-2x oneDNN for the few rows of a decode step); otherwise through oneDNN with
    the weight reordered once (a third faster than nn.Linear's MKL path) where oneDNN has the dtype;
    elsewhere torch's linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
                 kernel: Kernels | None = None) -> None:
        on_cpu = weight.device.type == "cpu"
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel if pack and kernel_takes(kernel, weight) else None
        self.packed = pack and on_cpu and self.kernel is None and onednn_takes(weight.dtype)
        self.bias = bias
        if self.kernel is not None:
            self.dtype = weight.dtype
            self._linear = self.kernel.linear_f32 if weight.dtype == torch.float32 else self.kernel.linear_bf16
            self.weight = pack_weight(self.kernel, weight)
            self.bias = None if bias is None else bias.contiguous()
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            if x.dtype != self.dtype:
                raise TypeError(f"linear layer in {self.dtype} got {x.dtype} input")
            x = x.contiguous()
            y = x.new_empty(*x.shape[:-1], self.out_features)
            self._linear(x=x.data_ptr(), M=x.numel() // self.in_features, K=self.in_features,
                         packed=self.weight.data_ptr(), N=self.out_features,
                         bias=None if self.bias is None else self.bias.data_ptr(), y=y.data_ptr(),
                         num_threads=torch.get_num_threads())
            return y
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear layer runs this dtype on this CPU: float32 wherever oneDNN is built in;
    bfloat16 only where torch says oneDNN supports it (AVX-512 or AVX-NE-CONVERT: elsewhere reordering the
    weight raises); float16 never (torch's own path)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def kernel_takes(kernel: Kernels | None, weight: torch.Tensor) -> bool:
    """Whether our C linear layers run this weight: float32, and bfloat16 where the CPU has AVX512-BF16."""
    return kernel is not None and weight.device.type == "cpu" and (
        weight.dtype == torch.float32
        or weight.dtype == torch.bfloat16 and bool(kernel.linear_bf16_available(K=weight.shape[1])))


def pack_weight(kernel: Kernels, weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the C linear layers' panels."""
    pack = kernel.pack_linear_f32 if weight.dtype == torch.float32 else kernel.pack_linear_bf16
    n, k = weight.shape
    out = torch.empty(kernel.linear_packed_size(N=n, K=k), dtype=weight.dtype)
    pack(w=weight.contiguous().data_ptr(), N=n, K=k, out=out.data_ptr(), num_threads=torch.get_num_threads())
    return out


class GatedLinear:
    """The MLP's input: silu(x Wg^T) * (x Wu^T). With our C linear layers, one pass: the tiles of the
    gate and of the up projection for the same columns meet in cache and leave as the activation, so the
    [rows, 2 × intermediate] product is never written out and read back (the same bits as the two steps).
    Otherwise one fused linear layer, then Ops.silu_mul."""

    def __init__(self, gate: torch.nn.Linear, up: torch.nn.Linear, pack: bool, kernel: Kernels | None,
                 ops: Ops) -> None:
        self.ops = ops
        self.in_features, self.out_features = gate.in_features, gate.out_features
        self.linear: Linear | None = None
        if pack and gate.bias is None and up.bias is None and kernel_takes(kernel, gate.weight):
            self.dtype = gate.weight.dtype
            self.weight = torch.cat([pack_weight(kernel, lin.weight.detach()) for lin in (gate, up)])
            self._function = kernel.linear_silu_mul_f32 if self.dtype == torch.float32 else kernel.linear_silu_mul_bf16
        else:
            self.linear = fused(gate, up, pack=pack, kernel=kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.ops.silu_mul(self.linear(x))
        if x.dtype != self.dtype:
            raise TypeError(f"linear layer in {self.dtype} got {x.dtype} input")
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], self.out_features)
        self._function(x=x.data_ptr(), M=x.numel() // self.in_features, K=self.in_features,
                       packed=self.weight.data_ptr(), n=self.out_features, out=out.data_ptr(),
                       num_threads=torch.get_num_threads())
        return out


def fused(*linears: torch.nn.Linear, pack: bool, kernel: Kernels | None = None) -> Linear:
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None if all(b is None for b in biases) else torch.cat([
        b.detach() if b is not None else torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
        for b, lin in zip(biases, linears, strict=True)])
    return Linear(weight, bias, pack, kernel)


class Ops:
    """RMSNorm (with the residual add before it), SiLU-and-multiply, argmax, the sampler's candidates and
    grammar masks:
    our C kernels on CPU for float32 and bfloat16, otherwise the torch code of Hugging Face's modules."""

    def __init__(self, kernel: Kernels | None, dtype: torch.dtype, sampler: Kernels | None = None) -> None:
        self.kernel = kernel if dtype in DTYPE_CODES else None  # for norms and activations in the model's dtype
        self.argmax_kernel = kernel
        self.sampler_kernel = sampler  # the sampler family's (cpu_paths): candidates and grammar masks
        self.dtype_code = DTYPE_CODES.get(dtype, -1)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += residual (in place, when given), then RMSNorm(x) as a new tensor. x: [rows, hidden]."""
        if self.kernel is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = torch.empty_like(x)
            self.kernel.rms_norm(x=x.data_ptr(), residual=None if residual is None else residual.data_ptr(),
                                 weight=weight.data_ptr(), out=out.data_ptr(), rows=x.shape[0], cols=x.shape[1],
                                 eps=eps, dtype=self.dtype_code, num_threads=torch.get_num_threads())
            return out
        if residual is not None:
            x.add_(residual)
        return rms_norm_torch(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * n] -> silu(gate) * up [rows, n]."""
        rows, width = gate_up.shape
        if self.kernel is not None and gate_up.is_contiguous():
            out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
            self.kernel.silu_mul(gate_up=gate_up.data_ptr(), out=out.data_ptr(), rows=rows, cols=width // 2,
                                 dtype=self.dtype_code, num_threads=torch.get_num_threads())
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor | None:
        """Rotate the first num_heads heads of each row of qkv [rows, width] in place (q's then k's
        heads). Returns None where the C kernel does not apply (the caller rotates with torch)."""
        if self.kernel is None or qkv.stride(-1) != 1 or not cos.is_contiguous() or not sin.is_contiguous():
            return None
        self.kernel.rope(x=qkv.data_ptr(), rows=qkv.shape[0], row_stride=qkv.stride(0), num_heads=num_heads,
                         head_dim=head_dim, cos=cos.data_ptr(), sin=sin.data_ptr(), dtype=self.dtype_code,
                         num_threads=torch.get_num_threads())
        return qkv

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of float32 logits [rows, vocab] (int64); torch's own is 4× slower on CPU."""
        if self.argmax_kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" \
                and logits.stride(-1) == 1 and logits.shape[0] > 0:
            out = torch.empty(logits.shape[0], dtype=torch.int64)
            self.argmax_kernel.argmax_rows(x=logits.data_ptr(), rows=logits.shape[0], cols=logits.shape[1],
                                           row_stride=logits.stride(0), out=out.data_ptr(),
                                           num_threads=torch.get_num_threads())
            return out
        return logits.argmax(dim=-1)

    def candidates(self, logits: torch.Tensor, index: torch.Tensor | None, inverse_t: torch.Tensor,
                   want_z: torch.Tensor | None, cut: int) -> tuple[torch.Tensor, ...] | None:
        """The sampler's pass over the vocabulary (csrc/sampling.c) for rows `index` of float32 logits (None:
        all): their `cut` best logits and ids [n, cut] (by value, ties by id), their largest logit [n], the
        log of their normaliser at temperature 1 / inverse_t [n, 1] (where want_z, int32 [n], is nonzero) and
        the candidates' places in order of token id [n, cut].
        None where the C kernel does not apply (the sampler does it in torch)."""
        if self.sampler_kernel is None or logits.dtype != torch.float32 or logits.device.type != "cpu" \
                or logits.stride(-1) != 1:
            return None
        rows = logits.shape[0] if index is None else index.shape[0]
        values = torch.empty(rows, cut)
        ids, by_id = torch.empty(rows, cut, dtype=torch.int64), torch.empty(rows, cut, dtype=torch.int64)
        best, log_z = torch.empty(rows), torch.empty(rows, 1)
        inverse_t = inverse_t.contiguous()
        self.sampler_kernel.row_candidates(
            x=logits.data_ptr(), rows=rows, cols=logits.shape[1], row_stride=logits.stride(0),
            rows_index=None if index is None else index.data_ptr(), inv_t=inverse_t.data_ptr(),
            want_z=None if want_z is None else want_z.data_ptr(), cut=cut, values=values.data_ptr(),
            ids=ids.data_ptr(), by_id=by_id.data_ptr(), best=best.data_ptr(), log_z=log_z.data_ptr(),
            num_threads=torch.get_num_threads())
        return values, ids, best, log_z, by_id

    def mask_tokens(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> bool:
        """-inf in place for the tokens a grammar's bitmask refuses (mask [len(rows), words] int32, as
        llguidance fills it) in these rows of float32 logits; False where the C kernel does not apply."""
        if self.sampler_kernel is None or logits.dtype != torch.float32 or logits.device.type != "cpu" \
                or logits.stride(-1) != 1 or not mask.is_contiguous() or mask.dtype != torch.int32:
            return False
        index = None if rows == list(range(logits.shape[0])) else torch.tensor(rows, dtype=torch.int64)
        self.sampler_kernel.mask_tokens(
            x=logits.data_ptr(), rows=len(rows), cols=logits.shape[1], row_stride=logits.stride(0),
            rows_index=None if index is None else index.data_ptr(), mask=mask.data_ptr(), words=mask.shape[1],
            num_threads=torch.get_num_threads())
        return True


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb for one of q, k: x [tokens, heads, head_dim], cos/sin [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class _Layer:
    def __init__(self, layer: torch.nn.Module, pack: bool, linear_kernel: Kernels | None,
                 gated_kernel: Kernels | None, ops: Ops) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = fused(attn.q_proj, attn.k_proj, attn.v_proj, pack=pack, kernel=linear_kernel)
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
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
    Each kernel family (linear layers, the gated MLP input, the small ops) runs in C or torch as `paths` says."""

    def __init__(self, model: torch.nn.Module, paths: CpuPaths, pack: bool, ops: Any = None) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight.detach()
        self.final_eps = inner.norm.variance_epsilon
        self.ops = ops or Ops(paths.c("small_ops"), self.final_norm.dtype)  # or TritonOps, on a GPU
        self.layers = [_Layer(layer, pack, paths.c("linear"), paths.c("gated_mlp"), self.ops) for layer in inner.layers]
        head = model.lm_head
        self.lm_head = Linear(head.weight.detach(), None if head.bias is None else head.bias.detach(), pack,
                              paths.c("linear"))
        model.lm_head = torch.nn.Identity()  # its (packed) copy is ours now; tied embeddings keep theirs

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 meta: attention.AttentionMetadata) -> torch.Tensor:
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


def make_forward(model: torch.nn.Module, paths: CpuPaths, pack: bool,
                 ops: Any = None) -> Callable[..., torch.Tensor] | None:
    """The lean forward for this model, or None where it must run through Hugging Face's modules."""
    if unsupported_reason(model) is not None:
        return None
    return LlamaForward(model, paths, pack, ops)

"""The small ops of a forward pass and of the sampler on a CPU: RMSNorm (with the residual add before it),
SiLU-and-multiply, rotary embeddings, argmax, the sampler's candidates and grammar masks. Each runs in our C
kernels where `paths.py` chose C for its family and the dtype is one they take, else in torch (the
reference: Hugging Face's math, layers.py). gpu/ops.TritonOps is the same interface on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bulkgen.engine.cpu.kernels import Kernels

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the dtypes the C kernels take, as they number them


class Ops:
    """RMSNorm (with the residual add before it), SiLU-and-multiply, argmax, the sampler's candidates and
    grammar masks:
    our C kernels on CPU for float32 and bfloat16, otherwise the torch code of Hugging Face's modules."""

    def __init__(self, kernel: Kernels | None, dtype: torch.dtype, sampler: Kernels | None = None) -> None:
        self.kernel = kernel if dtype in DTYPE_CODES else None  # for norms and activations in the model's dtype
        self.argmax_kernel = kernel
        self.sampler_kernel = sampler  # the sampler family's (paths.py): candidates and grammar masks
        self.dtype_code = DTYPE_CODES.get(dtype)  # None: no C kernel takes it

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

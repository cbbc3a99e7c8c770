"""The C versions of RMSNorm (+ residual add), SiLU-and-multiply, RoPE, argmax, the sampler's candidates
and the linear layers against the torch code of Hugging Face's modules they replace, in every build (native, without
AVX512-BF16, without AVX-512, x86-64 baseline)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bulkgen.engine.cpu.ops import Ops, rms_norm_torch
from bulkgen.engine.grammar import mask_logits
from bulkgen.engine.layers import GatedLinear, Linear, fused, onednn_takes, rotate
from tests.builds import BF16_LINEAR_BUILDS, BUILDS, HAS_AMX, HAS_AVX512F, builds, kernel

# float32: a K=576 reduction summed in another order differs by a few ulps of its largest terms (~1e-6)
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1 / 64, atol=1e-2)}


def _ops(dtype: torch.dtype, build: str = "native") -> Ops:
    return Ops(kernel(build), dtype, sampler=kernel(build))


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(build: str, dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).to(dtype)
    residual = torch.randn(37, 576).to(dtype) if with_residual else None
    weight = torch.rand(576).to(dtype) + 0.5
    want_x = x + residual if with_residual else x.clone()
    want = rms_norm_torch(want_x, weight, 1e-5)
    got = _ops(dtype, build).add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, want_x), "the residual is added in place, rounded as torch's add"
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1536, 37])
def test_silu_mul(build: str, dtype: torch.dtype, cols: int) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(19, 2 * cols) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(_ops(dtype, build).silu_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.skipif(not HAS_AVX512F, reason="one vector code on a CPU without AVX-512")
def test_silu_mul_is_the_same_bits_in_avx512_and_avx2() -> None:
    """vec.h's exp has an AVX-512 form of the same operations (max/min clamps, vscalefps): across the whole
    range exp takes (clamped past -87 and 88), infinities and NaN, float32 SiLU-and-multiply gives the same
    bits as the AVX2 build's. (In bfloat16 the AVX512-BF16 rounding instruction flushes subnormal results to
    zero where the AVX2 rounding keeps them: within torch's bfloat16 tolerance, tested above.)"""
    gate = torch.cat([torch.linspace(-120, 120, 40_000), torch.randn(4_000) * 1e-3,
                      torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40])])
    gate_up = torch.cat([gate, torch.randn(gate.numel())]).view(1, -1)
    wide, narrow = (_ops(torch.float32, build).silu_mul(gate_up) for build in ("native", "no-avx512"))
    assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32))


@builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_equals_hugging_face(build: str, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    tokens, heads, kv_heads, head_dim = 11, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    want_q, want_k, want_v = rotate(q, cos, sin), rotate(k, cos, sin), qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert _ops(dtype, build).rope(qkv, heads + kv_heads, head_dim, cos, sin) is qkv
    assert torch.equal(qkv[:, :heads * head_dim].view(tokens, heads, head_dim), want_q)
    assert torch.equal(qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim), want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], want_v), "v is left alone"


@builds
def test_argmax_first_on_ties_and_nan_wins(build: str) -> None:
    ops = _ops(torch.float32, build)
    torch.manual_seed(3)
    logits = torch.randn(6, 49152)
    logits[1, 7] = logits[1, 9000] = 50.0  # a tie: the first index, as torch
    logits[2, 49151] = 60.0  # in the tail past the last full vector
    logits[3, 123] = float("nan")
    logits[4, 5] = float("inf")
    got = ops.argmax(logits)
    assert got.tolist()[:3] == logits[:3].argmax(dim=-1).tolist() == [logits[0].argmax().item(), 7, 49151]
    assert got[3] == 123 and got[4] == 5
    assert torch.equal(ops.argmax(logits[:, :1000]), logits[:, :1000].argmax(dim=-1)), "strided rows"


def _candidates_by_torch(logits: torch.Tensor, cut: int, inverse_t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The whole row sorted by value, ties by id (a stable sort): its first `cut`, and the normaliser."""
    values, ids = (t[:, :cut] for t in logits.sort(dim=-1, descending=True, stable=True))
    log_z = ((logits - values[:, :1]) * inverse_t).exp().sum(dim=-1, keepdim=True).log()
    return values, ids, log_z


@builds
@pytest.mark.parametrize(("vocab", "cut"), [(49152, 256), (49152, 4096), (1001, 256), (100, 100)])
def test_sampler_candidates_are_torchs_topk_by_value_then_id(build: str, vocab: int, cut: int) -> None:
    """The sampler's one pass (csrc/sampling.c): each row's best `cut` logits and ids as a stable sort of the
    whole row gives them (by value, ties by token id: torch's topk picks among ties at its edge), their order by
    id, the row's max and the log of its normaliser at the row's temperature; masked rows (fewer finite logits
    than the cut), ties across the cut's edge, rows a filter picks out (index), strided rows, vocabularies that
    are no multiple of a vector, cuts wider than pass 1's groups; a row holding NaN or +inf, or only -inf,
    reports that max."""
    ops = _ops(torch.float32, build)
    gen = torch.Generator().manual_seed(vocab + cut)
    logits = torch.randn(12, vocab + 3, generator=gen)[:, :vocab] * 3  # strided rows
    logits[6, min(50, vocab - 1):] = float("-inf")  # a grammar's mask: fewer finite logits than the cut
    logits[7] = 0.0  # all tied
    logits[8] = logits[8].round()  # many ties at the cut's edge
    logits[9, vocab // 2] = float("nan")
    logits[10, 3] = float("inf")
    logits[11] = float("-inf")
    inverse_t = torch.rand(12, 1, generator=gen) + 0.5
    want_z = torch.tensor([1, 0] * 6, dtype=torch.int32)
    values, ids, best, log_z, by_id = ops.candidates(logits, None, inverse_t, want_z, cut)
    good = list(range(9))
    want_values, want_ids, want_log_z = _candidates_by_torch(logits[good], cut, inverse_t[good])
    assert torch.equal(values[good], want_values) and torch.equal(ids[good], want_ids)
    assert torch.equal(by_id[good], want_ids.argsort(dim=-1))
    assert torch.equal(best[good], logits[good].amax(dim=-1))
    asked = [r for r in good if want_z[r]]
    torch.testing.assert_close(log_z[asked], want_log_z[asked], rtol=1e-5, atol=1e-5)
    assert best[9].isnan() and best[10] == float("inf") and best[11] == float("-inf")
    index = torch.tensor([8, 0, 6], dtype=torch.int64)
    picked = ops.candidates(logits, index, inverse_t[index], want_z[index], cut)
    for got, full in zip(picked, (values, ids, best, log_z, by_id), strict=True):
        assert torch.equal(got, full[index]), "rows picked by index, as the same rows of the whole batch"
    assert ops.candidates(logits.bfloat16(), None, inverse_t, want_z, cut) is None, "float32 only"


@builds
@pytest.mark.parametrize(("vocab", "words"), [(49152, 1536), (1001, 32), (1001, 30)])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [4, 1]])
def test_grammar_masks_in_place_as_the_unpacked_bitmask(build: str, vocab: int, words: int, rows: list[int]) -> None:
    """A grammar's bitmask applied by the C kernel gives the logits the numpy-unpacking path gives: refused
    tokens -inf, the rest untouched, for every row or some rows, and tokens past the mask's words refused."""
    gen = torch.Generator().manual_seed(vocab + words + len(rows))
    logits = torch.randn(5, vocab, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int32)
    mask[0, :3] = -1  # all allowed
    mask[-1, 3:6] = 0  # all refused
    want = logits.clone()
    mask_logits(want, rows, mask)
    assert _ops(torch.float32, build).mask_tokens(logits, rows, mask)
    assert torch.equal(logits, want)


@builds
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 10, 11, 18, 37, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (100, 64), (5, 3), (49, 1537)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_float32_kernel(build: str, rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    """Every row-group split (tiles of 1..10 rows with AVX-512, 1..6 otherwise), partial last panels (N not a
    multiple of the panel width: 48, 16 or 8 columns), odd K."""
    torch.manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    bias = torch.randn(out_features) if with_bias else None
    linear = Linear(weight, bias, pack=True, kernel=kernel(build))
    assert linear.kernel is not None, "float32 on CPU runs through the C kernel"
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x.t().contiguous().t()), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@builds
def test_linear_float32_kernel_is_batch_invariant(build: str) -> None:
    """Each output is one summation chain over the inputs, whatever the number of rows: a request's
    logits are the same bits whichever other requests share its step."""
    torch.manual_seed(5)
    weight = torch.randn(300, 576) / 24
    linear = Linear(weight, None, pack=True, kernel=kernel(build))
    x = torch.randn(33, 576)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(33)])
    assert torch.equal(linear(x), alone)
    assert torch.equal(linear(x[:18]), alone[:18])


BF16_LINEAR = pytest.mark.parametrize("build", BF16_LINEAR_BUILDS or [
    pytest.param("native", marks=pytest.mark.skip(reason="the C bfloat16 linear layers need AMX or AVX512-BF16 "
                                                          "(oneDNN runs them otherwise; declining is tested below)"))])


@BF16_LINEAR
@pytest.mark.parametrize("rows", [1, 4, 18, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (100, 64), (49, 1538)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_bfloat16_kernel(build: str, rows: int, out_features: int, in_features: int, with_bias: bool) -> None:
    """float32 sums of bfloat16 products, rounded once: within one bfloat16 rounding of the exact result,
    like oneDNN's bfloat16 linear. On AMX tiles (native, on an AMX CPU) and on AVX512-BF16 (native
    elsewhere, and the no-amx build on an AMX CPU)."""
    torch.manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    linear = Linear(weight, bias, pack=True, kernel=kernel(build))
    assert linear.kernel is not None, "bfloat16 on a CPU with AMX or AVX512-BF16 runs through the C kernel"
    assert linear.kernel.amx == (HAS_AMX and build == "native")
    x = torch.randn(rows, in_features).bfloat16()
    got = linear(x)
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), exact, rtol=1 / 128, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1 / 64, atol=1e-2)


@pytest.mark.skipif(not HAS_AMX, reason="AMX tiles need an Intel Xeon of the 4th generation or later (the other "
                                        "bfloat16 paths are tested on every CPU)")
@pytest.mark.parametrize(("out_features", "in_features"), [(70, 2048), (33, 77), (17, 31)])
def test_linear_bfloat16_on_amx_tiles_any_shape_any_rows(out_features: int, in_features: int) -> None:
    """AMX tiles hold 16 rows x 32 inputs x 16 outputs; shapes and batches that fill none of them exactly
    (K and N not multiples of the tile, K odd, 1 to 1,024 rows, more rows than one L2 group: 2,048 inputs
    take groups of 256 rows and chunks of 512 inputs) stay within a bfloat16 rounding of the exact result,
    and each row's result is the same bits alone or in a batch (one summation order per output)."""
    torch.manual_seed(in_features)
    weight = (torch.randn(out_features, in_features) / in_features ** 0.5).bfloat16()
    linear = Linear(weight, None, pack=True, kernel=kernel())
    assert linear.kernel is not None and linear.kernel.amx
    x = torch.randn(1024, in_features).bfloat16()
    got = linear(x)
    exact = F.linear(x.double(), weight.double())
    torch.testing.assert_close(got.double(), exact, rtol=1 / 128, atol=1e-3)
    for rows in (1, 15, 16, 17, 33, 300):
        assert torch.equal(linear(x[:rows]), got[:rows])
    assert torch.equal(linear(x[500:501]), got[500:501])


def test_linear_bfloat16_without_avx512_bf16_runs_through_torch() -> None:
    """Built without AVX512-BF16 (and AMX) the kernel declines bfloat16, and torch takes it: oneDNN where it
    runs bfloat16 on this CPU, else torch's plain linear (oneDNN's weight reorder raises there). Odd K:
    AVX512-BF16 declines it (AMX takes it, through a zero-padded tail: tested above)."""
    weight = torch.randn(96, 64).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    portable = Linear(weight, None, pack=True, kernel=kernel("no-avx512bf16"))
    odd = Linear(torch.randn(96, 63).bfloat16(), None, pack=True, kernel=kernel("no-amx" if HAS_AMX else "native"))
    for linear in (portable, odd):
        assert linear.kernel is None and linear.packed == onednn_takes(torch.bfloat16)
    torch.testing.assert_close(portable(x), F.linear(x, weight), rtol=1 / 64, atol=1e-2)


@pytest.mark.parametrize("build", [*BUILDS, *(["no-amx"] if HAS_AMX else [])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("intermediate", "hidden"), [(1536, 576), (100, 64)])
def test_gated_linear_is_the_fused_linear_then_silu_mul(build: str, dtype: torch.dtype, intermediate: int,
                                                        hidden: int) -> None:
    """The MLP input in one pass (SiLU-and-multiply as the GEMM's epilogue) gives the same bits as the
    fused gate|up linear layer followed by silu_mul, for every row-group split and a partial last panel
    (bfloat16: on AMX tiles and on AVX512-BF16)."""
    if dtype == torch.bfloat16 and build not in BF16_LINEAR_BUILDS:
        pytest.skip("the bfloat16 linear kernel needs an AMX or AVX512-BF16 CPU and build (declining is tested "
                    "above)")
    if dtype == torch.float32 and build not in BUILDS:
        pytest.skip("the no-amx build's float32 code is the native one")
    torch.manual_seed(intermediate)
    gate, up = (torch.nn.Linear(hidden, intermediate, bias=False).to(dtype) for _ in range(2))
    ops = _ops(dtype, build)
    one_pass = GatedLinear(gate, up, pack=True, kernel=kernel(build), ops=ops)
    two_steps = fused(gate, up, pack=True, kernel=kernel(build))
    assert one_pass.linear is None, "the C kernel takes it"
    # 1,300 rows: more than one L2 group of AMX tiles (the threads split the rows, each its groups)
    for rows in (1, 7, 10, 11, 37, 300, 1300):
        x = torch.randn(rows, hidden).to(dtype)
        got = one_pass(x)
        assert got.shape == (rows, intermediate) and got.dtype == dtype
        assert torch.equal(got, ops.silu_mul(two_steps(x)))
    reference = F.silu(F.linear(x, gate.weight)) * F.linear(x, up.weight)
    torch.testing.assert_close(got, reference, **TOLERANCE[dtype])


def test_gated_linear_without_the_kernel_is_torch() -> None:
    torch.manual_seed(9)
    gate, up = torch.nn.Linear(64, 96), torch.nn.Linear(64, 96)  # biases: the kernel path declines them
    x = torch.randn(5, 64)
    for library in (None, kernel()):
        layer = GatedLinear(gate, up, pack=True, kernel=library, ops=Ops(library, torch.float32))
        assert layer.linear is not None
        torch.testing.assert_close(layer(x), F.silu(gate(x)) * up(x), rtol=1e-5, atol=1e-6)

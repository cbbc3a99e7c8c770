"""--quantization gguf (engine/blocks.py, engine/gguf_load.py, cpu/csrc/qblocks.c) against outside references:
each format's decoding against the gguf package's own dequantization (bit for bit), the integer products against
int64 dot products (bit for bit, in every build), the layers against float64 products of gguf-dequantized weights
and activations quantized per block of 32 in numpy (written here), and greedy decoding equal to Hugging Face
`generate()` on the model transformers loads from the same GGUF file, its linear layers replaced by that
reference layer."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.blocks import BlockLinear, Blocks, _Part, decode
from bulkgen.engine.engine import Engine
from bulkgen.errors import ConfigError
from bulkgen.resolve import resolve_model
from tests.builds import INT8_BUILDS, kernel
from tests.test_quant import engine_greedy, hf_greedy
from tests.tiny_gguf import _random_k_blocks, make_tiny_gguf

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _raw(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A weight [rows, cols] in GGUF blocks of `kind`: quantized by gguf-py where it can, else random K blocks."""
    if kind in ("Q4_K", "Q6_K"):
        return _random_k_blocks(kind, rows, cols, rng)
    return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), GGMLQuantizationType[kind])


def _layer(blocks: Blocks, build: str | None) -> BlockLinear:
    return BlockLinear([_Part(blocks, None if build is None else kernel(build))], None)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_equals_the_gguf_package(kind: str) -> None:
    rng = np.random.default_rng(0)
    raw = _raw(kind, 40, 512, rng)
    np.testing.assert_array_equal(decode(raw, kind, 512).dequantize(), dequantize(raw, GGMLQuantizationType[kind]))


def _unit_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> Blocks:
    """Blocks whose scales are small integers (d = 1): every weight an integer, every product exact in float32."""
    top = {"Q8_0": 256, "Q6_K": 64}.get(kind, 16)
    u = rng.integers(0, top, (n, k)).astype(np.uint8)
    per = 16 if kind == "Q6_K" else 32
    ones16 = np.full((n, k // per), 1.0, np.float16).view(np.uint16)
    if kind in ("Q8_0", "Q4_0"):
        return Blocks(kind, u, ones16)
    if kind == "Q4_1":
        return Blocks(kind, u, ones16, rng.integers(-3, 4, (n, k // 32)).astype(np.float16).view(np.uint16))
    d = np.ones((n, k // 256), np.float32)
    if kind == "Q4_K":
        return Blocks(kind, u, d, d.copy(), rng.integers(1, 4, (n, k // 32)).astype(np.uint8),
                      rng.integers(0, 4, (n, k // 32)).astype(np.uint8))
    return Blocks(kind, u, d, sc=rng.integers(-3, 4, (n, k // 16)).astype(np.int8).view(np.uint8))


@pytest.mark.parametrize("build", INT8_BUILDS)
@pytest.mark.parametrize("kind", KINDS)
def test_integer_products_are_exact(kind: str, build: str) -> None:
    """x integers whose block of 32 reaches 127 quantizes with scale 1, and the blocks' scales are integers: the
    layer's output is then the int64 product itself, bit for bit (N not a multiple of the 32-row panels)."""
    rng = np.random.default_rng(1)
    for m, n, k in [(1, 48, 256), (5, 100, 512), (13, 64, 768), (96, 40, 256)]:  # 96 rows: panels unpacked once
        blocks = _unit_blocks(kind, n, k, rng)
        w = blocks.dequantize().astype(np.int64)
        x = rng.integers(-127, 128, (m, k))
        x[:, ::32] = 127
        got = _layer(blocks, build)(torch.tensor(x, dtype=torch.float32))
        assert torch.equal(got, torch.tensor((x @ w.T).astype(np.float32))), (m, n, k)


def _quantized_x(x: np.ndarray) -> np.ndarray:
    """x [M, K] quantized per block of 32 in float32 arithmetic (d = max|x| / 127, round half to even) and back,
    in float64."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    d = np.where(d > 0, d, np.float32(1))
    return (np.clip(np.rint(blocks / d), -127, 127) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("build", [*INT8_BUILDS, None], ids=[*INT8_BUILDS, "torch"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_equals_the_reference(kind: str, build: str | None, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(2)
    raw = _raw(kind, 72, 512, rng)
    x = torch.tensor(rng.standard_normal((7, 512)).astype(np.float32)).to(dtype)
    expected = _quantized_x(x.float().numpy()) @ dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64).T
    got = _layer(decode(raw, kind, 512), build)(x)
    assert got.dtype == dtype and got.shape == (7, 72)
    scale = np.abs(expected).max()
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(got.float().numpy(), expected, rtol=tolerance, atol=tolerance * scale)


@pytest.mark.parametrize("build", INT8_BUILDS)
def test_a_rows_output_never_depends_on_the_rows_beside_it(build: str) -> None:
    """Each row alone and within steps of 1 to 43 rows (every split into row tiles, uneven ones included) gives
    the same bits, for the int8 layers (plain and the gated one-pass) and each GGUF block format."""
    from bulkgen.engine.cpu.ops import Ops
    from bulkgen.engine.quant import Int8GatedLinear, Int8Linear

    rng = np.random.default_rng(5)
    x = torch.tensor(rng.standard_normal((43, 256)).astype(np.float32)).to(torch.bfloat16)
    gate, up = torch.nn.Linear(256, 64, bias=False), torch.nn.Linear(256, 64, bias=False)
    layers = {"int8": Int8Linear(gate.weight, None, kernel(build)),
              "int8 gated": Int8GatedLinear(gate, up, Ops(kernel(build), torch.bfloat16), kernel(build))}
    layers.update((kind, _layer(decode(_raw(kind, 40, 256, rng), kind, 256), build)) for kind in KINDS)
    for name, layer in layers.items():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(43)])
        for m in (7, 13, 31, 37, 43):
            assert torch.equal(layer(x[:m]), alone[:m]), (name, m)


class _ReferenceLinear(torch.nn.Module):
    """An nn.Linear of the weights transformers dequantized from the GGUF file (with the gguf package), its
    activations quantized per block of 32: in float64, numpy."""

    def __init__(self, linear: torch.nn.Linear, quantized: bool) -> None:
        super().__init__()
        self.quantized = quantized  # the file's matrix is quantized (else a float matrix: an exact product)
        self.w = linear.weight.detach().double().numpy().copy()
        self.b = None if linear.bias is None else linear.bias.detach().double().numpy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).detach().numpy()
        y = (_quantized_x(rows) if self.quantized else rows.astype(np.float64)) @ self.w.T
        if self.b is not None:
            y = y + self.b
        return torch.tensor(y, dtype=x.dtype).reshape(*x.shape[:-1], -1)


def _hf_reference_greedy(gguf: Path, workload: list[tuple[list[int], int]],
                         float_layers: tuple[str, ...]) -> list[list[int]]:
    """float_layers: the layers (o_proj, ...) the file holds as float matrices."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, _ReferenceLinear(child, name not in float_layers))
    return hf_greedy(model, workload)


# Every kept type in one model, as a Q4_K_M file mixes them; qwen2 adds biases on q, k, v and a float matrix
# (F16) among the blocks
FAMILIES = {
    "llama": {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "Q8_0", "output": "Q6_K"},
    "qwen2": {"*": "Q4_0", "ffn_up": "Q4_1", "attn_output": "F16", "attn_v": "Q8_0"},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of 256 wide as a GGUF file with a byte-level tokenizer (converts in about a second)."""
    out = tmp_path_factory.mktemp("blocks") / f"tiny-{request.param}.gguf"
    return make_tiny_gguf(out, None, arch=request.param, width=256, ffn=512, kinds=FAMILIES[request.param])


def _float_layers(gguf: Path) -> tuple[str, ...]:
    """The layers the tiny file holds as float matrices."""
    return ("o_proj",) if FAMILIES[gguf.stem.removeprefix("tiny-")].get("attn_output") == "F16" else ()


def test_gguf_greedy_equals_hf_generate_with_reference_layers(tiny_gguf: Path) -> None:
    """Each path (our lean forward with the C kernels; the same with the products in torch; Hugging Face's
    modules with the blocks' layers in them) against HF generate() on the model transformers loads from the
    same file with the reference layer."""
    model_dir = resolve_model(str(tiny_gguf)).path
    rng = random.Random(5)
    workload = [([rng.randrange(0, 256) for _ in range(n)], rng.randint(4, 16)) for n in (1, 9, 40, 130)]
    expected = _hf_reference_greedy(tiny_gguf, workload, _float_layers(tiny_gguf))
    for kernels, lean in (("c", True), ("torch", True), ("c", False)):
        engine = Engine(model_dir, EngineConfig(quantization="gguf", kernels=kernels, fast_forward=lean,
                                                kv_cache_memory=1 << 22, max_num_batched_tokens=64))
        assert "GGUF blocks (" in engine.describe()
        assert (engine.runner.forward is not None) == lean
        if lean:
            parts = engine.runner.forward.layers[0].qkv.parts
            assert all((part.kernel is not None) == (kernels == "c") for part in parts)
        assert engine_greedy(engine, workload) == expected, (kernels, lean)


def test_gguf_needs_a_gguf_model(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--quantization gguf runs a GGUF file's own blocks"):
        Engine(tiny_model_dir, EngineConfig(quantization="gguf", kv_cache_memory=1 << 22))



def test_a_type_without_a_kernel_is_requantized_to_q8_0(tmp_path: Path) -> None:
    """Q5_0 has no kernel: its values (as the gguf package dequantizes them) run as Q8_0 blocks (as the gguf
    package quantizes them), with a line saying so."""
    from gguf import GGUFReader

    from bulkgen.engine.blocks import GGUFLinear
    from bulkgen.engine.gguf_load import load_gguf

    gguf = make_tiny_gguf(tmp_path / "q5.gguf", None, arch="qwen2", kinds={"attn_k": "Q5_0"})
    model_dir = resolve_model(str(gguf)).path
    model = load_gguf(gguf, model_dir, torch.float32, kernel("native"))
    layer = model.model.layers[1].self_attn.k_proj
    assert isinstance(layer, GGUFLinear) and layer.linear.kinds() == ["Q8_0"]
    raw = next(t for t in GGUFReader(gguf).tensors if t.name == "blk.1.attn_k.weight")
    values = dequantize(np.asarray(raw.data), GGMLQuantizationType.Q5_0)
    requantized = dequantize(quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float32)
    expected = _quantized_x(x) @ requantized.astype(np.float64).T + layer.bias.detach().double().numpy()
    np.testing.assert_allclose(layer(torch.tensor(x)).numpy(), expected, rtol=2e-6, atol=2e-6)


def test_auto_keeps_the_blocks_where_the_dequantized_weights_do_not_fit(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With memory for the blocks but not for the dequantized weights (BULKGEN_MEMORY_LIMIT), the file converts
    to its config and tokenizer only, auto runs its blocks, and none says what to do instead."""
    from bulkgen.engine.memory import CPU_HEADROOM_BYTES, MEMORY_LIMIT_ENV, MIN_KV_BYTES
    from bulkgen.gguf_info import GGUFInfo, gguf_info

    gguf = make_tiny_gguf(tmp_path / "small-machine.gguf", None, width=256, ffn=512, kinds={"*": "Q4_K"})
    info = GGUFInfo.of_file(gguf, weights=True)
    blocks, dequantized = info.bytes_in(4), 2 * (info.float_values + info.block_values)
    assert blocks < dequantized
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(MIN_KV_BYTES + CPU_HEADROOM_BYTES + (blocks + dequantized) // 2))
    model_dir = resolve_model(str(gguf)).path
    assert not list(model_dir.glob("*.safetensors")) and gguf_info(model_dir).weights is False
    engine = Engine(model_dir, EngineConfig())
    assert engine.config.quantization == "gguf" and "GGUF blocks (Q4_K)" in engine.describe()
    assert len(list(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))))
    with pytest.raises(ConfigError, match="run it with --quantization gguf"):
        Engine(model_dir, EngineConfig(quantization="none"))


def test_gguf_on_the_triton_path_equals_hf_generate_with_reference_layers(tiny_gguf: Path) -> None:
    """The GPU path (Triton attention, KV write and small ops, here in Triton's CPU interpreter; the blocks'
    products in torch, as on a GPU) against the same reference."""
    pytest.importorskip("triton")
    rng = random.Random(7)
    workload = [([rng.randrange(0, 256) for _ in range(n)], 5) for n in (3, 40)]
    expected = _hf_reference_greedy(tiny_gguf, workload, _float_layers(tiny_gguf))
    engine = Engine(resolve_model(str(tiny_gguf)).path,
                    EngineConfig(quantization="gguf", attention_backend="triton", block_size=16,
                                 kv_cache_memory=1 << 22, max_num_batched_tokens=32))
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    assert engine.runner.forward.layers[0].down.parts[0].kernel is None
    assert engine_greedy(engine, workload) == expected

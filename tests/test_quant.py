"""--quantization int8 (engine/quant.py) against references written here, in float64 and int64: the integer
products bit-exact, the layers' outputs to float rounding, and greedy decoding equal to Hugging Face
`generate()` on the same model with its linear layers replaced by the reference W8A8 layer."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.cpu.kernels import Kernels, load_cpu_kernels
from bulkgen.engine.engine import Engine
from bulkgen.engine.quant import Int8Linear
from bulkgen.errors import ConfigError
from tests.builds import HAS_AMX, HAS_AVX512F, HAS_AVX_VNNI
from tests.test_model_families import SLIDING, tiny_model


def _quantize(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of each row of a (last axis) in float32 arithmetic: (ints, scales as float64)."""
    a = a.astype(np.float32)
    scale = np.abs(a).max(axis=-1, keepdims=True) / np.float32(127)
    scale = np.where(scale > 0, scale, np.float32(1))
    return np.clip(np.rint(a / scale), -127, 127).astype(np.int64), scale.astype(np.float64)


def _reference_w8a8(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """The int8 product in int64 and float64: w per row, x per block of 32 (zero-padded), each block's dot
    product in integers, the blocks' sum in float64."""
    m, k = x.shape
    pad = -k % 32
    xq, xs = _quantize(np.pad(x, ((0, 0), (0, pad))).reshape(m, -1, 32))  # [m, nb, 32], [m, nb, 1]
    wq, ws = _quantize(w)
    wq = np.pad(wq, ((0, 0), (0, pad))).reshape(wq.shape[0], -1, 32)  # [n, nb, 32]
    dots = np.einsum("mbk,nbk->mnb", xq, wq).astype(np.float64)  # exact
    y = (dots * xs[:, None, :, 0]).sum(-1) * ws.T
    return y if bias is None else y + bias


KERNELS = {"c": "", "torch": None}
if HAS_AVX512F:
    KERNELS["c-avx2-build"] = "-mno-avx512f -mno-avxvnni"  # vpmaddubsw (AMD Zen 3's), as tests/builds.py's
    if HAS_AVX_VNNI:
        KERNELS["c-avx-vnni-build"] = "-mno-avx512f"  # 256-bit vpdpbusd
KERNELS["c-baseline-build"] = "-march=x86-64"  # the plain-C version


def _kernel(name: str) -> Kernels | None:
    flags = KERNELS[name]
    return None if flags is None else load_cpu_kernels(tuple(flags.split()))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_integer_products_are_exact(kernel: str) -> None:
    """Integer-valued rows whose largest value in each block of 32 (x) and in each row (w) is 127 quantize with
    scale 1: the layer's output is then the int64 dot product itself, bit for bit (small enough for float32's
    24 bits; K not a multiple of 32, N not of 32: the panels' padding)."""
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 64, 48), (5, 577, 190), (13, 1536, 100), (40, 256, 64)]:
        x = rng.integers(-127, 128, (m, k))
        w = rng.integers(-20, 21, (n, k))
        x[:, ::32], w[:, 0] = 127, 127
        layer = Int8Linear(torch.tensor(w, dtype=torch.float32), None, _kernel(kernel))
        assert torch.equal(layer(torch.tensor(x, dtype=torch.float32)), torch.tensor((x @ w.T).astype(np.float32)))


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "torch"])
def test_activation_ties_round_to_even(kernel: str) -> None:
    """x / d exactly halfway between two integers rounds to the even one, as torch.round: each block's largest
    |x| is 127 (d = 1), the other values k + 0.5, and w, 127 times the identity (scale 1), picks each quantized
    value out, times 127."""
    k = 70  # two full blocks and a zero-padded one
    x = np.tile(np.arange(k) % 60 - 29.5, (3, 1)).astype(np.float32)
    x[:, ::32] = 127
    x[1] = -x[1]
    layer = Int8Linear(torch.eye(k) * 127, None, _kernel(kernel))
    got = layer(torch.tensor(x))
    assert torch.equal(got, torch.round(torch.tensor(x)) * 127)


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k != "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_layer_in_one_pass_equals_the_two_steps(dtype: torch.dtype, kernel: str) -> None:
    """The MLP input through the one-pass kernel (each panel's gate and up sums meet in cache) has the same bits
    as the int8 product of the fused weight followed by silu_mul (ops.c), and lies within float rounding of
    silu(gate) * up from the float64 reference layer."""
    from bulkgen.engine.cpu.ops import Ops
    from bulkgen.engine.quant import Int8GatedLinear

    rng = np.random.default_rng(2)
    gate, up = torch.nn.Linear(200, 96, bias=False), torch.nn.Linear(200, 96, bias=False)
    x = torch.tensor(rng.standard_normal((13, 200)).astype(np.float32)).to(dtype)
    ops = Ops(_kernel(kernel), dtype)
    layer = Int8GatedLinear(gate, up, ops, _kernel(kernel))
    assert layer.one_pass
    got = layer(x)
    assert torch.equal(got, ops.silu_mul(layer.linear(x)))
    reference = _reference_w8a8(x.float().numpy(), torch.cat([gate.weight, up.weight]).detach().numpy())
    g, u = reference[:, :96], reference[:, 96:]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    np.testing.assert_allclose(got.float().numpy(), g / (1 + np.exp(-g)) * u, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_equals_the_reference(dtype: torch.dtype, kernel: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 320)).astype(np.float32)
    x[3] = 0  # a row of zeros quantizes to zeros, not NaN
    w = (rng.standard_normal((96, 320)) * 0.05).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    x_in = torch.tensor(x).to(dtype)
    layer = Int8Linear(torch.tensor(w), torch.tensor(bias), _kernel(kernel))
    expected = _reference_w8a8(x_in.float().numpy(), w, bias)
    got = layer(x_in)
    assert got.dtype == dtype and got.shape == (7, 96)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(got.float().numpy(), expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[3].float(), torch.tensor(bias).to(dtype).float())


class _ReferenceLinear(torch.nn.Module):
    """An nn.Linear's W8A8 product through _reference_w8a8 (numpy), for Hugging Face's own modules."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.w = linear.weight.detach().numpy().copy()
        self.b = None if linear.bias is None else linear.bias.detach().double().numpy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).detach().numpy()
        y = _reference_w8a8(rows, self.w, self.b)
        return torch.tensor(y, dtype=x.dtype).reshape(*x.shape[:-1], -1)


def _hf_w8a8_model(model_dir: Path) -> torch.nn.Module:
    """Hugging Face's model of these weights, every linear layer but the head the reference W8A8 one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not head:
                setattr(parent, name, _ReferenceLinear(child))
    return model


def _hf_w8a8_greedy(model_dir: Path, workload: list[tuple[list[int], int]]) -> list[list[int]]:
    return hf_greedy(_hf_w8a8_model(model_dir), workload)


def hf_greedy(model: torch.nn.Module, workload: list[tuple[list[int], int]]) -> list[list[int]]:
    """Each (prompt, n) of the workload through HF generate(): n tokens, greedy, EOS not stopping it."""
    out = []
    with torch.inference_mode():
        for prompt, max_new in workload:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                       min_new_tokens=max_new, do_sample=False)
            out.append(generated[0, len(prompt):].tolist())
    return out


def engine_greedy(engine: Engine, workload: list[tuple[list[int], int]]) -> list[list[int]]:
    """The same workload through the engine, all at once."""
    for i, (prompt, max_new) in enumerate(workload):
        engine.add(i, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o.output_token_ids) for o in engine.step())
    return [outputs[i] for i in range(len(workload))]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_greedy_equals_hf_generate_with_reference_layers(family: str, tiny_model_dir: Path,
                                                               tiny_qwen2_dir: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Each path (our lean forward with the C kernels, the int8 products included; the same in torch; Hugging
    Face's modules) against HF generate() on the same weights with the reference W8A8 layer (qwen2: biases on
    q, k, v). The weights are quantized as they are read (int8_load.py), not after a float load."""
    caplog.set_level(logging.INFO, logger="bulkgen.engine.loading")
    model_dir = {"llama": tiny_model_dir, "qwen2": tiny_qwen2_dir}[family]
    rng = random.Random(3)
    workload = [([rng.randrange(100, 40000) for _ in range(n)], rng.randint(4, 24)) for n in (1, 9, 40, 130)]
    expected = _hf_w8a8_greedy(model_dir, workload)
    for kernels, lean in (("c", True), ("torch", True), ("c", False)):
        engine = Engine(model_dir, EngineConfig(quantization="int8", kernels=kernels, fast_forward=lean,
                                                kv_cache_memory=1 << 22, max_num_batched_tokens=64))
        assert "int8 weights" in engine.describe()
        assert (engine.runner.forward is not None) == lean
        if lean:
            assert (engine.runner.forward.layers[0].down.kernel is not None) == (kernels == "c")
            assert engine.runner.forward.layers[0].mlp_in.one_pass == (kernels == "c")
        assert engine_greedy(engine, workload) == expected, (kernels, lean)
    assert "first" not in caplog.text  # no float load


def test_int8_sampled_draws_come_from_the_reference_models_distribution(tiny_model_dir: Path) -> None:
    """Sampled (temperature, top-p, seeded) through the int8 C path: every drawn token's logprob equals the
    reference W8A8 model's (Hugging Face's modules, numpy layers) at that position, and lies inside the support
    transformers' warpers keep; the sampler's draws themselves are checked against the warpers in
    test_sampler.py."""
    from tests.test_sampler import _hf_probs

    model = _hf_w8a8_model(tiny_model_dir)
    engine = Engine(tiny_model_dir, EngineConfig(quantization="int8", kernels="c", kv_cache_memory=1 << 22))
    rng = random.Random(4)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, logprobs=1, ignore_eos=True)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    for i, prompt in enumerate(prompts):
        engine.add(i, prompt, dataclasses.replace(params, seed=50 + i))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    drawn = 0
    for out in outputs.values():
        ids = torch.tensor([prompts[out.request_id] + out.output_token_ids[:-1]])
        with torch.inference_mode():
            logits = model(ids).logits[0, -len(out.output_token_ids):].double()
        for position, (token, entry) in enumerate(zip(out.output_token_ids, out.logprobs, strict=True)):
            reference = torch.log_softmax(logits[position], -1)[token].item()
            assert abs(entry["logprob"] - reference) < 1e-3, (out.request_id, position, entry, reference)
            assert _hf_probs(logits[position].float(), params)[token] > 0
            drawn += token != int(logits[position].argmax())
    assert drawn > 0  # not greedy in disguise


@pytest.mark.parametrize("family", ["phi3", "gemma3", "mixtral"])
def test_int8_of_other_families_equals_hf_generate_with_reference_layers(family: str, tmp_path: Path,
                                                                         default_model_dir: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Families through Hugging Face's modules, their weights quantized as they are read (phi3: fused q/k/v and
    gate/up projections, partial rotary; gemma3: tied embeddings, sliding layers) or, where the checkpoint names
    its weights otherwise (mixtral's experts, saved one by one, which transformers fuses at load), loaded in
    float and quantized after, with the line that says so: each against HF generate() with the reference W8A8
    layers, past the window."""
    caplog.set_level(logging.INFO, logger="bulkgen.engine.loading")
    config_class, fields = SLIDING[family]
    tied = dict(tie_word_embeddings=True) if family == "gemma3" else {}
    model_dir = tiny_model(tmp_path / family, default_model_dir, config_class, **fields, **tied)
    rng = random.Random(5)
    workload = [([rng.randrange(100, 40000) for _ in range(n)], m) for n, m in ((3, 30), (40, 6))]
    expected = _hf_w8a8_greedy(model_dir, workload)
    engine = Engine(model_dir, EngineConfig(quantization="int8", kernels="c", kv_cache_memory=1 << 22,
                                            max_num_batched_tokens=32))
    assert engine.runner.forward is None and "int8 weights" in engine.describe()
    assert engine_greedy(engine, workload) == expected
    assert ("first (its checkpoint's names are not its modules'" in caplog.text) == (family == "mixtral")


@pytest.mark.skipif(not HAS_AMX, reason="the line is for CPUs with AMX tiles")
def test_int8_on_an_amx_cpu_says_bfloat16_is_faster(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On AMX the bfloat16 GEMM outruns the int8 one (VNNI): the run says so in one line, and still runs int8."""
    with caplog.at_level(logging.WARNING):
        engine = Engine(tiny_model_dir, EngineConfig(quantization="int8", kv_cache_memory=1 << 20))
    assert "int8 weights" in engine.describe()
    assert sum("saves memory on this CPU, not time" in r.getMessage() for r in caplog.records) == 1


def test_int8_load_keeps_the_generation_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The end-of-sequence ids come from generation_config.json, as from_pretrained reads them, however the weights
    are loaded."""
    import shutil

    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [7, 9]}))
    for quantization in ("int8", "none"):
        engine = Engine(model_dir, EngineConfig(quantization=quantization, kv_cache_memory=1 << 20))
        assert engine.eos_token_ids == {7, 9}, quantization


LOAD_PEAK = """
import sys
from pathlib import Path
from bulkgen.config import EngineConfig
from bulkgen.engine.loading import plan
from bulkgen.engine.runner import ModelRunner
def status(key): return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key)))
config = EngineConfig(quantization="int8", kv_cache_memory=1 << 22)
ModelRunner(sys.argv[1], plan(sys.argv[1], config))  # once first: libraries, kernels, threads, the race in place
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) counts from here
before = status("VmRSS")
ModelRunner(sys.argv[1], plan(sys.argv[1], config))
print((status("VmHWM") - before) * 1024)
"""


def test_int8_loads_in_about_its_quantized_size(tmp_path: Path, default_model_dir: Path) -> None:
    """A model of 52 M float32 linear weights (210 MB; tied embeddings of 13 M) through --quantization int8, in a
    process of its own, loaded a second time (the libraries, kernels, threads and the kernels' race in place
    from the first): the second load's peak memory (Linux's VmHWM, reset just before it) grows by at most about
    the int8 weights and the float embeddings, far below the float weights, which a float load then quantized
    held at once (before int8_load.py: 358 MB; now 50-100 MB)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=8192, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if type(m) is torch.nn.Linear and name != "lm_head")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    del model
    grown = int(subprocess.run([sys.executable, "-c", LOAD_PEAK, str(tmp_path)],
                               capture_output=True, text=True, check=True).stdout.split()[-1])
    int8_and_embeddings = linear + len(tokenizer) * 256 * 4
    assert grown < int8_and_embeddings + 64 * 2**20, (grown, linear)


def test_a_bad_quantization_is_one_line() -> None:
    with pytest.raises(ConfigError, match="quantization must be one of auto, none, int8, gguf, got 'int4'"):
        EngineConfig(quantization="int4")


def test_int8_on_the_triton_path_equals_hf_generate_with_reference_layers(tiny_llama64_dir: Path) -> None:
    """The GPU path (Triton attention, KV write and small ops, here in Triton's CPU interpreter; the int8 layers
    in torch, as on a GPU) against the same reference."""
    pytest.importorskip("triton")
    rng = random.Random(4)
    workload = [([rng.randrange(100, 40000) for _ in range(n)], 6) for n in (3, 40)]
    expected = _hf_w8a8_greedy(tiny_llama64_dir, workload)
    engine = Engine(tiny_llama64_dir, EngineConfig(quantization="int8", attention_backend="triton", block_size=16,
                                                   kv_cache_memory=1 << 22, max_num_batched_tokens=32))
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    assert engine.runner.forward.layers[0].down.kernel is None
    assert engine_greedy(engine, workload) == expected

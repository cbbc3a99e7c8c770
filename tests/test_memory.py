"""Weights that fit: --dtype auto loads float32 where the model fits beside its KV cache, else bfloat16 where the
CPU computes it natively, and refuses with the numbers, before loading anything, where nothing fits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bulkgen.engine.memory import CPU_HEADROOM_BYTES, MEMORY_LIMIT_ENV, available_memory, choose_dtype, native_dtypes
from bulkgen.errors import ConfigError
from bulkgen.model import ModelShape, estimated_weight_count, read_config, weight_count
from tests.helpers import invoke, invoke_json, write_parquet
from tests.test_model_families import tiny_model

GIB = 2**30
EIGHT_B = 8_030_000_000  # Llama-3.1-8B's weights


def test_auto_takes_float32_where_it_fits_and_bfloat16_where_only_that_fits() -> None:
    both = {"bfloat16"}
    assert choose_dtype("auto", 135_000_000, None, 8 * GIB, both, False, "m") == "float32"
    # an 8B model on a 24 GiB machine: 32 GB in float32 does not fit, 16 GB in bfloat16 does
    assert choose_dtype("auto", EIGHT_B, 2 * GIB, 22 * GIB, both, False, "m") == "bfloat16"
    assert choose_dtype("auto", EIGHT_B, None, 64 * GIB, both, False, "m") == "float32"
    assert choose_dtype("auto", EIGHT_B, None, 4 * GIB, both, True, "m") == "bfloat16"  # a GPU: its own sizing


def test_what_fits_in_no_dtype_is_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"fits in no dtype.*8\.03 B weights take 15\.0 GiB in bfloat16.*"
                                          r"KV cache 2\.0 GiB.*12\.0 GiB of memory is free"):
        choose_dtype("auto", EIGHT_B, 2 * GIB, 12 * GIB, {"bfloat16"}, False, "llama-8b")
    with pytest.raises(ConfigError, match="no native bfloat16.*29.9 GiB in float32"):
        choose_dtype("auto", EIGHT_B, 2 * GIB, 22 * GIB, set(), False, "llama-8b")  # an AVX2-only CPU
    with pytest.raises(ConfigError, match=r"does not fit in float32.*--dtype bfloat16 \(or auto\) fits"):
        choose_dtype("float32", EIGHT_B, 2 * GIB, 22 * GIB, {"bfloat16"}, False, "llama-8b")
    assert choose_dtype("bfloat16", EIGHT_B, 2 * GIB, 22 * GIB, {"bfloat16"}, False, "m") == "bfloat16"
    with pytest.raises(ConfigError, match="a KV cache of 30.0 GiB does not fit.*lower --kv-cache-memory"):
        choose_dtype("auto", 1000, 30 * GIB, 22 * GIB, {"bfloat16"}, False, "tiny")


def test_weights_are_counted_from_the_safetensors_headers(tmp_path: Path, default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(tmp_path / "m", default_model_dir, "Qwen3Config", head_dim=16)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert weight_count(model_dir) == sum(p.numel() for p in model.parameters())
    estimate = estimated_weight_count(ModelShape.of(read_config(model_dir)))
    assert abs(estimate - weight_count(model_dir)) < 0.02 * weight_count(model_dir)
    assert weight_count(tmp_path) is None
    linear = sum(m.weight.numel() for m in model.modules()
                 if type(m) is torch.nn.Linear and m is not model.get_output_embeddings())
    assert weight_count(model_dir, vocab=model.config.vocab_size) == linear  # what --quantization int8 keeps in int8


def test_int8_counts_the_linear_weights_at_a_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8B Llama's safetensors (its header only: shapes, no data) on a machine with 16 GiB free: float32 needs
    32 GB and bfloat16 16 GB beside the KV cache, so neither fits, and --quantization int8, which quantizes as
    it reads (7 B linear weights at a byte, the rest in float32), fits."""
    from transformers import LlamaConfig

    from bulkgen.config import EngineConfig
    from bulkgen.engine.memory import run_plan

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8)
    config.save_pretrained(tmp_path)
    shapes = {"model.embed_tokens.weight": [128256, 4096], "lm_head.weight": [128256, 4096],
              "model.norm.weight": [4096]}
    for i in range(32):
        layer = f"model.layers.{i}."
        shapes.update({layer + "self_attn.q_proj.weight": [4096, 4096], layer + "self_attn.k_proj.weight": [1024, 4096],
                       layer + "self_attn.v_proj.weight": [1024, 4096], layer + "self_attn.o_proj.weight": [4096, 4096],
                       layer + "mlp.gate_proj.weight": [14336, 4096], layer + "mlp.up_proj.weight": [14336, 4096],
                       layer + "mlp.down_proj.weight": [4096, 14336], layer + "input_layernorm.weight": [4096],
                       layer + "post_attention_layernorm.weight": [4096]})
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    assert weight_count(tmp_path) == 8_030_261_248  # Llama-3.1-8B's
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "16GiB")
    kv = 2 * GIB
    assert run_plan(tmp_path, EngineConfig(quantization="int8", kv_cache_memory=kv), False) == ("int8", "float32", None)
    with pytest.raises(ConfigError, match="fits in no dtype"):
        run_plan(tmp_path, EngineConfig(kv_cache_memory=kv), False)
    with pytest.raises(ConfigError, match=r"its int8 weights take 6\.6 GiB, its 1\.05 B other weights take"):
        run_plan(tmp_path, EngineConfig(quantization="int8", kv_cache_memory=7 * GIB), False)


def test_the_memory_limit_caps_what_counts_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    free = available_memory()
    assert 0 < free
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1GiB")
    assert available_memory() == min(free, GIB) or available_memory() <= GIB
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "lots")
    with pytest.raises(ConfigError, match=MEMORY_LIMIT_ENV):
        available_memory()


def test_a_model_too_big_for_float32_here_runs_in_bfloat16_or_is_refused(tmp_path: Path, db_url: str,
                                                                          default_model_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CLI, with free memory capped between the model's bfloat16 and float32 needs: auto runs it in
    bfloat16 where the CPU computes that natively, else refuses it (exit 2) with the numbers, nothing claimed."""
    model_dir = tiny_model(tmp_path / "m", default_model_dir, "LlamaConfig")
    weights = weight_count(model_dir)
    kv = 4 * 2**20
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(CPU_HEADROOM_BYTES + kv + 3 * weights))  # bf16 needs 2x, f32 4x
    data = write_parquet(tmp_path / "rows.parquet", {"prompt": ["Hello", "Hi there"]})
    job = invoke_json("submit", data, "--model", model_dir, "--max-new-tokens", 4)["job_id"]
    if "bfloat16" in native_dtypes():
        run = invoke("run", job, "--kv-cache-memory", kv)  # the run's first line names the dtype
        assert "bfloat16 on cpu" in run.output
        assert invoke_json("status", job)["counts"]["completed"] == 2
    else:
        run = invoke("run", job, "--kv-cache-memory", kv, "--no-progress", expect=2)
        assert "fits in no dtype" in run.output and "no native bfloat16" in run.output
        assert invoke_json("status", job)["counts"]["pending"] == 2, "nothing claimed"
    assert torch.get_default_dtype() == torch.float32


def test_a_cgroups_limit_counts(tmp_path: Path) -> None:
    """A container's memory limit (cgroup v2, else v1) caps what counts as free; "max" sets none."""
    from bulkgen.engine.memory import _cgroup_room

    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("73741824\n")
    assert _cgroup_room(tmp_path) == 1_000_000_000
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_room(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("2147483648\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("147483648\n")
    assert _cgroup_room(v1) == 2_000_000_000
    assert _cgroup_room(tmp_path / "none") is None

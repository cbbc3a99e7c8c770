"""Each CPU kernel family's path (C or torch), chosen on this machine: forced, refused where the C kernels
cannot take it, else measured once and cached; the dtype refused where the CPU has no arithmetic for it;
and what `bulkgen run -v` says about it all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bulkgen.config import KERNEL_FAMILIES, EngineConfig, parse_kernels
from bulkgen.engine import paths as cpu_paths
from bulkgen.engine.cpu import machine as cpu
from bulkgen.engine.engine import Engine
from bulkgen.errors import ConfigError
from bulkgen.model import ModelShape
from tests.builds import BUILDS, HAS_AMX, HAS_AVX512_BF16, kernel
from tests.helpers import invoke_json, write_parquet
from tests.zygote import run_bulkgen

SMOL = ModelShape(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64, vocab=49152,
                  layer_types=("full_attention",) * 30)
TINY = ModelShape(num_layers=2, hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, head_dim=64, vocab=32000,
                  layer_types=("full_attention",) * 2)


def choose(build, dtype: torch.dtype, shape: ModelShape, forced: dict[str, str], forced_by: str,
           lean: bool = True) -> cpu_paths.CpuPaths:
    return cpu_paths.choose(build, dtype, shape, 32 if shape is SMOL else 16, lean, forced, forced_by, "")


def test_kernels_spec() -> None:
    assert parse_kernels("auto") == {} and parse_kernels(" AUTO ") == {}
    assert parse_kernels("torch") == dict.fromkeys(KERNEL_FAMILIES, "torch")
    assert parse_kernels("linear=torch,attention=c") == {"linear": "torch", "decode_attention": "c",
                                                         "prefill_attention": "c"}
    assert parse_kernels("all=c,small_ops=auto") == {f: "c" for f in KERNEL_FAMILIES if f != "small_ops"}
    for bad in ("fast", "linear", "linear=gpu", "mlp=c", "linear=c,,"):
        with pytest.raises(ConfigError, match="FAMILY=PATH"):
            parse_kernels(bad)
    with pytest.raises(ConfigError, match="kernels"):
        EngineConfig(kernels="attention=fast")


def test_measured_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_paths, "BUSY_SHARE", 2.0)  # every measurement trusted (the suite's other worker runs)
    paths = choose(kernel(), torch.float32, TINY, {}, "test")
    assert paths.note.startswith("measured on this machine now")
    (cached,) = (tmp_path / "kernels").glob("paths-*.json")
    timings = json.loads(cached.read_text())
    for family in KERNEL_FAMILIES:
        c_s, torch_s = timings[family]
        assert 0 < c_s and 0 < torch_s
        assert paths.families[family].use_c == (c_s <= torch_s), "the faster path runs (C on a tie)"
        assert paths.families[family].reason.startswith("measured: ")
        assert (paths.c(family) is not None) == paths.families[family].use_c
    again = choose(kernel(), torch.float32, TINY, {}, "test")
    assert "cached" in again.note and again.families == paths.families
    other = choose(kernel(), torch.float32, SMOL, {}, "test")  # other shapes: measured anew
    assert other.note.startswith("measured on this machine now")
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 2


def test_a_race_on_a_busy_machine_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other processes hogging every CPU while the race runs: the result says so, is cached flagged busy, and
    is used while the machine stays busy; a result measured on a quiet machine is trusted as before."""
    monkeypatch.setenv("BULKGEN_CACHE", str(tmp_path))
    hogs = [subprocess.Popen([sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"],
                             stdout=subprocess.PIPE, text=True) for _ in range(os.cpu_count() or 2)]
    try:
        for hog in hogs:
            assert hog.stdout.readline() == "ready\n"
        assert cpu.others_share_now(0.2) > cpu_paths.BUSY_SHARE
        busy = choose(kernel(), torch.float32, TINY, {}, "test")
        assert "while other processes used" in busy.note and "measured again once it is idle" in busy.note
        (cached,) = (tmp_path / "kernels").glob("paths-*.json")
        assert json.loads(cached.read_text())["_busy"] > cpu_paths.BUSY_SHARE
        still_busy = choose(kernel(), torch.float32, TINY, {}, "test")
        assert "cached" in still_busy.note and still_busy.families == busy.families
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    timings = json.loads(cached.read_text())
    cached.write_text(json.dumps({**timings, "_busy": 0.0}))  # as if measured on a quiet machine
    quiet = choose(kernel(), torch.float32, TINY, {}, "test")
    assert "cached" in quiet.note and quiet.families == busy.families


def test_forced_paths_and_what_c_cannot_take(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKGEN_CACHE", str(tmp_path))
    forced = choose(kernel(), torch.float32, TINY, dict.fromkeys(KERNEL_FAMILIES, "c"), "--kernels c")
    assert all(p.use_c and p.reason == "forced by --kernels c" for p in forced.families.values())
    assert not list(tmp_path.glob("kernels/*.json")), "nothing measured when everything is forced"
    mixed = choose(kernel(), torch.float32, TINY, {"linear": "torch"}, "--kernels linear=torch")
    assert not mixed.families["linear"].use_c and mixed.families["linear"].reason == "forced by --kernels linear=torch"
    assert all(mixed.families[f].reason.startswith("measured") for f in KERNEL_FAMILIES if f != "linear")
    # float16: no C kernel of the model's takes it; asking for one says why (the sampler reads float32 logits)
    half = choose(kernel(), torch.float16, TINY, {}, "test")
    assert not any(p.use_c for f, p in half.families.items() if f != "sampler")
    assert "not float16" in half.families["linear"].reason and half.families["sampler"].reason.startswith("measured")
    with pytest.raises(ConfigError, match="asks for small_ops in C, but the C kernels take float32 and bfloat16"):
        choose(kernel(), torch.float16, TINY, {"small_ops": "c"}, "--kernels small_ops=c")
    # the C bfloat16 linear layers need AMX or AVX512-BF16: a build without them declines them, forced or not
    for build in BUILDS:
        if build == "native" and (HAS_AVX512_BF16 or HAS_AMX):
            continue
        bf16 = choose(kernel(build), torch.bfloat16, TINY, {"attention": "c"}, "test")
        assert not bf16.families["linear"].use_c and "AVX512-BF16" in bf16.families["linear"].reason
        with pytest.raises(ConfigError, match="linear in C, but the C bfloat16 linear layers need AMX, or AVX512-BF16"):
            choose(kernel(build), torch.bfloat16, TINY, {"linear": "c"}, "--kernels c")
    # the lean forward not running: the linear families are not used, whatever is asked
    hf = choose(kernel(), torch.float32, TINY, dict.fromkeys(KERNEL_FAMILIES, "c"), "--kernels c", lean=False)
    assert not hf.families["linear"].use_c and hf.families["linear"].reason.startswith("not used")
    assert hf.families["decode_attention"].use_c


def test_no_kernel_means_torch_everywhere(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BULKGEN_NO_KERNEL", "1")
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22))
    assert engine.runner.kernel is None
    assert all(not p.use_c and p.reason == "BULKGEN_NO_KERNEL is set" for p in engine.runner.paths.families.values())
    with pytest.raises(ConfigError, match="asks for linear in C, but BULKGEN_NO_KERNEL is set"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22, kernels="linear=c"))


def test_environment_forces_paths_and_config_wins(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_paths.KERNELS_ENV, "torch")
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22))
    assert engine.runner.paths.short() == "torch: " + " ".join(KERNEL_FAMILIES)
    assert engine.runner.paths.families["linear"].reason == "forced by BULKGEN_KERNELS=torch"
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22, kernels="c"))
    assert engine.runner.paths.short() == "C: " + " ".join(KERNEL_FAMILIES)
    monkeypatch.setenv(cpu_paths.KERNELS_ENV, "linear=fast")
    with pytest.raises(ConfigError, match="linear=fast"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22))


AVX2_ONLY = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2".split())


def test_dtype_without_native_arithmetic_is_refused(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with no bfloat16 (or float16) instructions torch emulates them, tens of times slower than
    float32: refused before the model loads, with the CPU named and float32 offered."""
    problem = cpu.native_dtype_problem("bfloat16", AVX2_ONLY)
    assert problem is not None and "AVX2 + FMA" in problem and "--dtype float32" in problem
    assert cpu.native_dtype_problem("float16", AVX2_ONLY) is not None
    assert cpu.native_dtype_problem("float32", AVX2_ONLY) is None
    assert cpu.native_dtype_problem("bfloat16", AVX2_ONLY | {"avx512f", "avx512_bf16"}) is None
    assert cpu.native_dtype_problem("bfloat16", AVX2_ONLY | {"amx_bf16"}) is None
    assert cpu.native_dtype_problem("float16", AVX2_ONLY | {"avx512_fp16"}) is None
    assert cpu.native_dtype_problem("bfloat16", frozenset()) is None, "flags unreadable: no refusal on a guess"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: AVX2_ONLY)  # this machine, seen as an AVX2-only one
    with pytest.raises(ConfigError, match="needs a CPU with native bfloat16"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22, dtype="bfloat16"))
    monkeypatch.setenv(cpu.ALLOW_SLOW_DTYPE_ENV, "1")
    Engine(tiny_model_dir, EngineConfig(kv_cache_memory=2**22, dtype="bfloat16"))


@pytest.mark.parametrize("build", list(BUILDS))
def test_each_build_runs_on_this_cpu(build: str) -> None:
    """Every library the tests build says this CPU runs all it was compiled for (the loader refuses one that
    does not, rather than die of an illegal instruction)."""
    assert kernel(build).kernel_isa_ok() == 1


def test_run_verbose_names_the_cpu_and_each_path(tmp_path: Path, db_url: str, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["Hello there", "What is two and two?"]})
    invoke_json("submit", data, "--model", tiny_model_dir, "--max-new-tokens", 4)
    done = run_bulkgen(["run", "-v", "--no-progress", "--kv-cache-memory", "4MiB", "--kernels", "linear=torch"],
                       timeout=300, env={**os.environ, "BULKGEN_DB": db_url})
    assert done.returncode == 0, done.stderr
    assert f"CPU {cpu.describe_cpu()}" in done.stderr
    assert "linear: torch (forced by --kernels linear=torch)" in done.stderr
    for family in KERNEL_FAMILIES:
        assert f"  {family}: " in done.stderr

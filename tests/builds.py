"""The builds of the C kernels that tests run against torch on whatever machine they land on: the one the
engine would use here (-march=native), and the portable ones every CPU kind may get: without AVX512-BF16,
without AVX-512 (AVX2 code, 16 registers of 8 floats) and the x86-64 baseline (SSE2, no extension). On a
CPU without AVX-512 the first three are the same code, built and run once."""

from __future__ import annotations

import platform

import pytest

from bulkgen.engine.cpu.kernels import load_cpu_kernels

NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")
_FLAGS = open("/proc/cpuinfo").read()
HAS_AVX512F = "avx512f" in _FLAGS
HAS_AVX512_BF16 = "avx512_bf16" in _FLAGS
HAS_AVX_VNNI = "avx_vnni" in _FLAGS
HAS_AMX = "amx_bf16" in _FLAGS and platform.machine() in ("x86_64", "AMD64")
if platform.machine() in ("x86_64", "AMD64"):
    _ALL = {"native": (), "no-avx512bf16": ("-mno-avx512bf16", *NO_AMX),
            "no-avx512": ("-mno-avx512f", "-mno-avxvnni", *NO_AMX), "x86-64": ("-march=x86-64",)}
    # Without AVX-512 the first three are one code (their flags turn off what -march=native did not turn on): the
    # tests build and run it once, as "native", and a test that names another of them gets it
    BUILDS = _ALL if HAS_AVX512F else {"native": (), "x86-64": _ALL["x86-64"]}
else:
    _ALL = BUILDS = {"native": ()}
# The builds whose C linear layers take bfloat16 on this CPU: AMX tiles (native, on an AMX CPU) and
# AVX512-BF16 (native elsewhere; without AMX on an AMX CPU, the path of an AMD Zen 4/5).
BF16_LINEAR_BUILDS = (["native"] if HAS_AVX512_BF16 or HAS_AMX else []) + (["no-amx"] if HAS_AMX else [])
# AVX2 with AVX-VNNI (the integer kernels' 256-bit vpdpbusd) where this CPU has it ("no-avx512": AVX2 without)
_EXTRA = {"no-amx": NO_AMX, "avx-vnni": ("-mno-avx512f", *NO_AMX)}
INT8_BUILDS = [*BUILDS, *(["avx-vnni"] if HAS_AVX_VNNI and HAS_AVX512F else [])]


def kernel(build: str = "native"):
    """The kernel library of a build (they build wherever gcc is present: CI has it)."""
    library = load_cpu_kernels(BUILDS.get(build, () if build in _ALL else _EXTRA.get(build, ())))
    assert library is not None, f"the {build} build of the kernels failed"
    return library


builds = pytest.mark.parametrize("build", list(BUILDS))

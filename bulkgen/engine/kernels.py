"""Our C kernels for the CPU (paged attention, the KV write, fused RMSNorm, SiLU-mul, argmax and
float32 linear layers): compiled once per machine, loaded with ctypes.

It needs only a C compiler with OpenMP (gcc), no torch headers, so it builds in well under a second.
Where no compiler is found the engine falls back to pure torch, slower but identical in results.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from bulkgen.config import Paths

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "ops.c", "gemm.c")
HEADERS = ("vec.h",)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 6 \
    + [ctypes.c_float, ctypes.c_int]
_WRITE_ARGS = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2 \
    + [ctypes.c_int] * 4


@cache
def load_cpu_kernels(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) when it cannot be built here.
    extra_flags: more compiler flags (tests build the portable paths with `-mno-avx512bf16`, say)."""
    if os.environ.get("BULKGEN_NO_KERNEL"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("bulkgen: no C compiler found; CPU decode attention falls back to torch (slower)")
        return None
    sources = {name: importlib.resources.files("bulkgen.engine").joinpath(f"csrc/{name}").read_text()
               for name in (*SOURCES, *HEADERS)}
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256("\n".join([*sources.values(), compiler, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = Paths().cache_dir / "kernels"
    library = out_dir / f"bulkgen-cpu-{key}.so"
    try:
        if not library.is_file():
            _compile(compiler, flags, sources, library)
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("bulkgen: could not build the CPU attention kernel (%s); falling back to torch", detail)
        return None
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        function = getattr(lib, name)
        function.argtypes = _ARGS
        function.restype = ctypes.c_int
    for name in ("paged_prefill_f32", "paged_prefill_bf16"):
        function = getattr(lib, name)
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_void_p] + [ctypes.c_int] * 4 \
            + [ctypes.c_float, ctypes.c_int]
        function.restype = ctypes.c_int
    for name in ("write_kv_4", "write_kv_2"):
        function = getattr(lib, name)
        function.argtypes = _WRITE_ARGS
        function.restype = None
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, argtypes in {"rms_norm": [p, p, p, p, i64, i64, ctypes.c_float, i, i],
                           "silu_mul": [p, p, i64, i64, i, i],
                           "argmax_rows": [p, i64, i64, i64, p, i],
                           "rope": [p, i64, i64, i, i, p, p, i, i],
                           "pack_linear_f32": [p, i64, i64, p, i],
                           "linear_f32": [p, i64, i64, p, i64, p, p, i],
                           "pack_linear_bf16": [p, i64, i64, p, i],
                           "linear_bf16": [p, i64, i64, p, i64, p, p, i],
                           "linear_silu_mul_f32": [p, i64, i64, p, i64, p, i],
                           "linear_silu_mul_bf16": [p, i64, i64, p, i64, p, i]}.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = None
    lib.linear_packed_size.argtypes = [i64, i64]
    lib.linear_packed_size.restype = i64
    lib.linear_bf16_available.argtypes = [i64]
    lib.linear_bf16_available.restype = i
    return lib


def _compile(compiler: str, flags: list[str], sources: dict[str, str], library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file():
            return
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            paths = []
            for name, text in sources.items():
                paths.append(Path(tmp) / name)
                paths[-1].write_text(text)
            built = Path(tmp) / library.name
            subprocess.run([compiler, *flags, *(str(p) for p in paths if p.suffix == ".c"), "-o", str(built), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(built, library)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""

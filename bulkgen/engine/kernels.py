"""Our C kernels for the CPU (paged attention, the KV write, fused RMSNorm, SiLU-mul, RoPE, argmax and
the linear layers): compiled once per machine with -march=native, loaded with ctypes.

It needs only a C compiler with OpenMP (gcc), no torch headers, so it builds in about a second. The
library is cached under a key of its sources, its flags and this CPU's flags, so a kernel built for one
CPU is never loaded on another; and it checks on load that this CPU runs every extension it was built
for. Where no compiler is found the engine falls back to pure torch, slower but identical in results.
Whether each kernel family then runs in C or torch is decided per machine (cpu_paths.py).
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
from bulkgen.engine.cpu import cpu_flags_line

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "ops.c", "gemm.c")
HEADERS = ("vec.h",)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
NO_KERNEL_ENV = "BULKGEN_NO_KERNEL"
# More compiler flags for the engine's build, e.g. "-mno-avx512f" to run the AVX2 kernels on an AVX-512 CPU
CFLAGS_ENV = "BULKGEN_KERNEL_CFLAGS"

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_DECODE = (_I, [_P] * 4 + [_I64, _P, _P] + [_I] * 6 + [_F, _I])
_PREFILL = (_I, [_P] * 4 + [_I] * 2 + [_P] + [_I] * 4 + [_F, _I])
_WRITE_KV = (None, [_P] * 2 + [_I64] * 4 + [_P, _I] + [_P] * 2 + [_I] * 4)
# Every C function the engine calls: name -> (return type, argument types), as defined in csrc/*.c.
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "paged_decode_f32": _DECODE, "paged_decode_bf16": _DECODE,
    "paged_prefill_f32": _PREFILL, "paged_prefill_bf16": _PREFILL,
    "write_kv_4": _WRITE_KV, "write_kv_2": _WRITE_KV,
    "rms_norm": (None, [_P, _P, _P, _P, _I64, _I64, _F, _I, _I]),
    "silu_mul": (None, [_P, _P, _I64, _I64, _I, _I]),
    "argmax_rows": (None, [_P, _I64, _I64, _I64, _P, _I]),
    "rope": (None, [_P, _I64, _I64, _I, _I, _P, _P, _I, _I]),
    "pack_linear_f32": (None, [_P, _I64, _I64, _P, _I]),
    "linear_f32": (None, [_P, _I64, _I64, _P, _I64, _P, _P, _I]),
    "pack_linear_bf16": (None, [_P, _I64, _I64, _P, _I]),
    "linear_bf16": (None, [_P, _I64, _I64, _P, _I64, _P, _P, _I]),
    "linear_silu_mul_f32": (None, [_P, _I64, _I64, _P, _I64, _P, _I]),
    "linear_silu_mul_bf16": (None, [_P, _I64, _I64, _P, _I64, _P, _I]),
    "linear_packed_size": (_I64, [_I64, _I64]),
    "linear_bf16_available": (_I, [_I64]),
    "kernel_isa_ok": (_I, []),
}


def load_cpu_kernels(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) when it cannot be built or run here.
    extra_flags: more compiler flags (tests build the portable paths with `-mno-avx512f`, say), after
    those of BULKGEN_KERNEL_CFLAGS."""
    if os.environ.get(NO_KERNEL_ENV):
        return None
    return _load((*os.environ.get(CFLAGS_ENV, "").split(), *extra_flags))


@cache
def _load(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("bulkgen: no C compiler found; the CPU engine runs in pure torch (slower)")
        return None
    sources = {name: importlib.resources.files("bulkgen.engine").joinpath(f"csrc/{name}").read_text()
               for name in (*SOURCES, *HEADERS)}
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256("\n".join([*sources.values(), compiler, *flags, cpu_flags_line()]).encode()).hexdigest()[:16]
    library = Paths().cache_dir / "kernels" / f"bulkgen-cpu-{key}.so"
    try:
        if not library.is_file():
            _compile(compiler, flags, sources, library)
        lib = ctypes.CDLL(str(library))
        for name, (restype, argtypes) in SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, argtypes
    except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("bulkgen: could not build the CPU kernels (%s); the CPU engine runs in pure torch", detail)
        return None
    if not lib.kernel_isa_ok():
        log.warning("bulkgen: %s was built for instructions this CPU lacks (a cache shared between machines?); "
                    "the CPU engine runs in pure torch. Delete it to rebuild here.", library)
        return None
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
            subprocess.run([compiler, *flags, *(str(p) for p in paths if p.suffix == ".c"), "-o", str(built), "-lm"],
                           check=True, capture_output=True, text=True)
            os.replace(built, library)

"""Our C kernels for the CPU (paged attention, the KV write, fused RMSNorm, SiLU-mul, RoPE, argmax, the
sampler's candidates, grammar masks and the linear layers): compiled once per machine with -march=native,
loaded with ctypes.

It needs only a C compiler with OpenMP (gcc), no torch headers, so it builds in about a second. The
library is cached under a key of its sources, its flags and this CPU's flags, so a kernel built for one
CPU is never loaded on another; and it checks on load that this CPU runs every extension it was built
for. Where no compiler is found the engine falls back to pure torch, slower but identical in results.
Whether each kernel family then runs in C or torch is decided per machine (paths.py).
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
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from bulkgen.config import Paths
from bulkgen.engine.cpu.machine import cpu_flags_line

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "ops.c", "gemm.c", "amx.c", "qgemm.c", "qblocks.c", "sampling.c")
HEADERS = ("vec.h", "idot.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
NO_KERNEL_ENV = "BULKGEN_NO_KERNEL"
# More compiler flags for the engine's build, e.g. "-mno-avx512f" to run the AVX2 kernels on an AVX-512 CPU
CFLAGS_ENV = "BULKGEN_KERNEL_CFLAGS"

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _params(text: str) -> list[tuple[str, type]]:
    """'x:p rows:i64 eps:f' -> [(name, ctypes type)]: p a pointer (a tensor's data_ptr(), or None), i64, i, f."""
    kinds = {"p": _P, "i64": _I64, "i": _I, "f": _F}
    return [(name, kinds[kind]) for name, kind in (item.split(":") for item in text.split())]


_DECODE = "q:p k_cache:p v_cache:p block_tables:p block_table_stride:i64 context_lens:p out:p num_seqs:i num_heads:i " \
          "num_kv_heads:i head_dim:i block_size:i max_context_len:i scale:f window:i softcap:f sinks:p num_threads:i"
_DECODE_SHARED = _DECODE + " order:p starts:p shared:p num_items:i"
_PREFILL = "q:p k_cache:p v_cache:p table:p start:i n:i out:p num_heads:i num_kv_heads:i head_dim:i block_size:i " \
           "scale:f window:i softcap:f sinks:p num_threads:i"
_WRITE_KV = "key:p value:p k_token_stride:i64 k_head_stride:i64 v_token_stride:i64 v_head_stride:i64 slots:p " \
            "num_tokens:i k_cache:p v_cache:p num_kv_heads:i head_dim:i block_size:i num_threads:i"
_LINEAR = "x:p M:i64 K:i64 packed:p N:i64 bias:p y:p num_threads:i"
_SILU_LINEAR = "x:p M:i64 K:i64 packed:p n:i64 out:p num_threads:i"
_PACK = "w:p N:i64 K:i64 out:p num_threads:i"
# Every C function the engine calls, as defined in csrc/*.c: name -> (return type, named parameters). The one
# place their signatures are kept: call sites name each argument (Kernels).
SIGNATURES: dict[str, tuple[type | None, str]] = {
    "paged_decode_f32": (_I, _DECODE), "paged_decode_bf16": (_I, _DECODE),
    "paged_decode_shared_f32": (_I, _DECODE_SHARED), "paged_decode_shared_bf16": (_I, _DECODE_SHARED),
    "paged_prefill_f32": (_I, _PREFILL), "paged_prefill_bf16": (_I, _PREFILL),
    "write_kv_4": (None, _WRITE_KV), "write_kv_2": (None, _WRITE_KV),
    "rms_norm": (None, "x:p residual:p weight:p out:p rows:i64 cols:i64 eps:f dtype:i num_threads:i"),
    "silu_mul": (None, "gate_up:p out:p rows:i64 cols:i64 dtype:i num_threads:i"),
    "argmax_rows": (None, "x:p rows:i64 cols:i64 row_stride:i64 out:p num_threads:i"),
    "row_candidates": (None, "x:p rows:i64 cols:i64 row_stride:i64 rows_index:p inv_t:p want_z:p cut:i values:p "
                             "ids:p by_id:p best:p log_z:p num_threads:i"),
    "mask_tokens": (None, "x:p rows:i64 cols:i64 row_stride:i64 rows_index:p mask:p words:i64 num_threads:i"),
    "rope": (None, "x:p rows:i64 row_stride:i64 num_heads:i head_dim:i cos:p sin:p dtype:i num_threads:i"),
    "pack_linear_f32": (None, _PACK), "pack_linear_bf16": (None, _PACK),
    "linear_f32": (None, _LINEAR), "linear_bf16": (None, _LINEAR),
    "linear_silu_mul_f32": (None, _SILU_LINEAR), "linear_silu_mul_bf16": (None, _SILU_LINEAR),
    "linear_packed_size": (_I64, "N:i64 K:i64"),
    "linear_bf16_available": (_I, "K:i64"),
    "pack_linear_amx": (None, _PACK), "linear_amx": (None, _LINEAR), "linear_silu_mul_amx": (None, _SILU_LINEAR),
    "amx_packed_size": (_I64, "N:i64 K:i64"), "amx_available": (_I, ""),
    "paged_prefill_amx": (_I, "q:p k_cache:p v_cache:p table:p start:i n:i out:p num_heads:i num_kv_heads:i "
                              "head_dim:i block_size:i scale:f num_threads:i"),
    "qlinear": (None, "x:p M:i64 K:i64 dtype:i packed:p N:i64 scale:p bias:p y:p num_threads:i"),
    "qlinear_silu_mul": (None, "x:p M:i64 K:i64 dtype:i packed:p N:i64 scale:p bias:p y:p num_threads:i"),
    "qlinear_silu_mul_takes": (_I, "N:i64"),
    "pack_qlinear": (None, "w:p N:i64 K:i64 out:p num_threads:i"),
    "qlinear_packed_size": (_I64, "N:i64 K:i64"), "qlinear_available": (_I, ""),
    "qblocks_linear": (None, "fmt:i x:p M:i64 K:i64 dtype:i packed:p N:i64 bias:p y:p ldy:i64 num_threads:i"),
    "pack_qblocks": (None, "fmt:i u:p N:i64 K:i64 s:p m:p sc:p mn:p out:p num_threads:i"),
    "qblocks_packed_size": (_I64, "fmt:i N:i64 K:i64"), "qblocks_takes": (_I, "fmt:i K:i64"),
    "qblocks_vnni": (_I, ""),
    "kernel_isa_ok": (_I, ""),
}


def named(function: ctypes._CFuncPtr, name: str, params: list[tuple[str, type]]) -> Callable[..., object]:
    """The C function as a Python one whose parameters are keyword-only, named as in C (a missing or unknown
    name is Python's own TypeError). Written out as source, as dataclasses and namedtuple do: a generic
    **kwargs wrapper cost 1.5 us a call, 3 % of a one-sequence decode step."""
    names = [n for n, _ in params]
    source = f"def {name}({'*, ' if names else ''}{', '.join(names)}):\n    return _c({', '.join(names)})\n"
    namespace: dict[str, object] = {"_c": function}
    exec(source, namespace)  # the names come from SIGNATURES above, never from input
    return namespace[name]


# The bfloat16 linear layers on AMX tiles (amx.c), where the library was built with AMX and Linux grants
# the process the tiles' state: they take the place of the AVX512-BF16 ones (gemm.c), layout included.
AMX_LINEAR = {"linear": "linear_amx", "pack_linear": "pack_linear_amx", "linear_silu_mul": "linear_silu_mul_amx"}


class Kernels:
    """The loaded library: each function of SIGNATURES as an attribute taking its arguments by name."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.path = Path(library._name)
        for name, (restype, text) in SIGNATURES.items():
            params = _params(text)
            function = getattr(library, name)
            function.restype, function.argtypes = restype, [kind for _, kind in params]
            setattr(self, name, named(function, name, params))
        self.amx = bool(self.amx_available())

    def typed(self, name: str, dtype: object) -> Callable[..., Any]:
        """The float32 (`NAME_f32`) or bfloat16 (`NAME_bf16`, or its AMX version) version of a kernel, for
        a torch dtype: the one place the element type picks the C function."""
        if str(dtype) == "torch.float32":
            return getattr(self, f"{name}_f32")
        return getattr(self, AMX_LINEAR[name] if self.amx and name in AMX_LINEAR else f"{name}_bf16")

    def linear_takes(self, dtype: object, K: int) -> bool:
        """Whether the C linear layers run a weight of this dtype with K inputs: float32 always; bfloat16 on
        AMX tiles, or with AVX512-BF16 and K even."""
        return str(dtype) == "torch.float32" or str(dtype) == "torch.bfloat16" and (
            self.amx or bool(self.linear_bf16_available(K=K)))

    def packed_size(self, dtype: object, N: int, K: int) -> int:
        """Elements of an [N, K] weight packed for the C linear layers (pack_linear)."""
        if self.amx and str(dtype) == "torch.bfloat16":
            return self.amx_packed_size(N=N, K=K)
        return self.linear_packed_size(N=N, K=K)

    def linear_name(self, dtype: object) -> str:
        """What the C linear layers compute with, for logs: 'AMX tiles', 'AVX512-BF16' or '' (float32)."""
        return "" if str(dtype) == "torch.float32" else "AMX tiles" if self.amx else "AVX512-BF16"


def load_cpu_kernels(extra_flags: tuple[str, ...] = ()) -> Kernels | None:
    """The compiled kernel library, or None (with one warning) when it cannot be built or run here.
    extra_flags: more compiler flags (tests build the portable paths with `-mno-avx512f`, say), after
    those of BULKGEN_KERNEL_CFLAGS."""
    if os.environ.get(NO_KERNEL_ENV):
        return None
    return _load((*os.environ.get(CFLAGS_ENV, "").split(), *extra_flags))


@cache
def _load(extra_flags: tuple[str, ...]) -> Kernels | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("bulkgen: no C compiler found; the CPU engine runs in pure torch (slower)")
        return None
    sources = {name: importlib.resources.files("bulkgen.engine.cpu").joinpath(f"csrc/{name}").read_text()
               for name in (*SOURCES, *HEADERS)}
    flags = [*FLAGS, *extra_flags]
    key = hashlib.sha256("\n".join([*sources.values(), compiler, *flags, cpu_flags_line()]).encode()).hexdigest()[:16]
    library = Paths().cache_dir / "kernels" / f"bulkgen-cpu-{key}.so"
    try:
        if not library.is_file():
            _compile(compiler, flags, sources, library)
        lib = Kernels(ctypes.CDLL(str(library)))
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

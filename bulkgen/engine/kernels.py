"""Our C paged-attention kernel for CPU decode steps: compiled once per machine, loaded with ctypes.

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

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 6 \
    + [ctypes.c_float, ctypes.c_int]
_WRITE_ARGS = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2 \
    + [ctypes.c_int] * 3


@cache
def load_paged_attention() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (with one warning) when it cannot be built here."""
    if os.environ.get("BULKGEN_NO_KERNEL"):
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("bulkgen: no C compiler found; CPU decode attention falls back to torch (slower)")
        return None
    source = importlib.resources.files("bulkgen.engine").joinpath("csrc/paged_attention.c").read_text()
    key = hashlib.sha256("\n".join([source, compiler, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = Paths().cache_dir / "kernels"
    library = out_dir / f"paged_attention-{key}.so"
    try:
        if not library.is_file():
            _compile(compiler, source, library)
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("bulkgen: could not build the CPU attention kernel (%s); falling back to torch", detail)
        return None
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        function = getattr(lib, name)
        function.argtypes = _ARGS
        function.restype = ctypes.c_int
    for name in ("write_kv_4", "write_kv_2"):
        function = getattr(lib, name)
        function.argtypes = _WRITE_ARGS
        function.restype = None
    return lib


def _compile(compiler: str, source: str, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file():
            return
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
            src = Path(tmp) / "paged_attention.c"
            src.write_text(source)
            built = Path(tmp) / library.name
            subprocess.run([compiler, *FLAGS, str(src), "-o", str(built), "-lm"], check=True,
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

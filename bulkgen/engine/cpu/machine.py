"""What this machine's CPU can do, read where the engine runs (never assumed from where it was built):
its instruction-set flags, a one-line description for logs, and whether a dtype has native arithmetic.

Imports nothing heavy; torch only inside the function that asks it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time
from functools import cache
from pathlib import Path

from bulkgen.errors import ConfigError

# Flags (as /proc/cpuinfo spells them) that give a dtype native arithmetic on the CPU: without them torch
# emulates it, and a bfloat16 matrix product ran 60-250x slower than float32 on an AVX2 CPU.
NATIVE_DTYPE_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),  # x86 AVX512-BF16, AMX-BF16; Arm BF16
    "float16": ("avx512_fp16", "amx_fp16", "fphp"),  # x86 AVX512-FP16, AMX-FP16; Arm half-precision arithmetic
}
NATIVE_DTYPE_NAMES = {"bfloat16": "AVX512-BF16 or AMX-BF16 (Arm: BF16)",
                      "float16": "AVX512-FP16 or AMX-FP16 (Arm: FP16 arithmetic)"}
ALLOW_SLOW_DTYPE_ENV = "BULKGEN_ALLOW_SLOW_DTYPE"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on Arm); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags_line() -> str:
    """The flags as one sorted line (what the compiled kernels are keyed by)."""
    return " ".join(sorted(cpu_flags()))


def describe_cpu(flags: frozenset[str] | None = None) -> str:
    """'AVX-512 + AVX512-BF16 + AMX', 'AVX2 + FMA', ...: the vector extensions that matter to the kernels."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return platform.machine() or "unknown CPU"
    parts = []
    if "avx512f" in flags:
        parts.append("AVX-512")
    elif "avx2" in flags:
        parts.append("AVX2")
    elif "avx" in flags:
        parts.append("AVX")
    elif "asimd" in flags:
        parts.append("NEON")
    elif "sse2" in flags:
        parts.append("SSE2")
    if "fma" in flags and "avx512f" not in flags:
        parts.append("FMA")
    for flag, name in (("avx512_bf16", "AVX512-BF16"), ("avx512_fp16", "AVX512-FP16"), ("amx_bf16", "AMX")):
        if flag in flags:
            parts.append(name)
    if "bf16" in flags:
        parts.append("BF16")
    return " + ".join(parts) or platform.machine()


def native_dtype_problem(dtype: str, flags: frozenset[str] | None = None) -> str | None:
    """Why `dtype` should not run on this CPU (None: it has native arithmetic for it, or it is float32, or
    the flags cannot be read here)."""
    flags = cpu_flags() if flags is None else flags
    if dtype not in NATIVE_DTYPE_FLAGS or not flags or any(f in flags for f in NATIVE_DTYPE_FLAGS[dtype]):
        return None
    return (f"--dtype {dtype} needs a CPU with native {dtype} arithmetic ({NATIVE_DTYPE_NAMES[dtype]}); this CPU "
            f"has {describe_cpu(flags)} and no {dtype} instructions, so torch would emulate every {dtype} "
            "matrix product, tens of times slower than float32. Use --dtype float32 (the default): on this CPU it "
            f"is the fast one. (To run {dtype} anyway, slowly, set {ALLOW_SLOW_DTYPE_ENV}=1.)")


def check_dtype_fits(dtype: str) -> None:
    """Refuse a dtype this CPU has no arithmetic for, unless BULKGEN_ALLOW_SLOW_DTYPE is set."""
    problem = native_dtype_problem(dtype)
    if problem is not None and not os.environ.get(ALLOW_SLOW_DTYPE_ENV):
        raise ConfigError(problem)


def torch_capability() -> str:
    """The vector extension torch's own CPU kernels were dispatched to (AVX512, AVX2, DEFAULT, ...)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def keep_freed_memory() -> None:
    """Ask glibc to keep freed activation buffers (up to 32 MiB each) on its heap instead of returning
    them to the kernel: otherwise every step maps them afresh and pays a page fault per 4 KiB, which cost
    a tenth of a prefill step here."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD: its maximum on 64-bit
    libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD


def release_freed_memory() -> None:
    """Hand what the heap keeps (keep_freed_memory) back to the kernel once: after loading, where a GGUF file's
    decoding or a model's repacking freed a gigabyte of temporaries the process would otherwise hold."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return


class OtherLoad:
    """The share of the machine's CPU time that other processes (and, in a guest, other guests: steal) used
    while a `with` block ran, from /proc/stat less this process's own CPU time; `share` stays None where
    /proc/stat cannot be read. A race of kernels measured beside a `pip install` once chose the slower paths
    for every later run (0.73x vLLM instead of 0.97x)."""

    share: float | None = None

    def __enter__(self) -> OtherLoad:
        self._start = _cpu_sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = _cpu_sample()
        if self._start is None or end is None:
            return
        (busy0, total0, own0), (busy1, total1, own1) = self._start, end
        tick = os.sysconf("SC_CLK_TCK")
        if total1 > total0:
            self.share = max(0.0, ((busy1 - busy0) / tick - (own1 - own0)) / ((total1 - total0) / tick))


def _cpu_sample() -> tuple[int, int, float] | None:
    """(busy, all) clock ticks of every CPU since boot, and this process's CPU seconds; None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    times = os.times()
    total = sum(fields)  # user nice system idle iowait irq softirq steal
    return total - fields[3] - fields[4], total, times.user + times.system


def others_share_now(seconds: float = 0.1) -> float | None:
    """OtherLoad's share over the next `seconds` (a measurement window: this process does nothing in it)."""
    with OtherLoad() as load:
        time.sleep(seconds)
    return load.share

"""Which path each CPU kernel family takes on this machine: bulkgen's C kernels or plain torch.

A kernel tuned on one CPU is a regression on another until measured (built for AVX2, the kernels tuned
on AVX-512 ran 4x slower than torch; on an AMX CPU torch's bfloat16 GEMM is 5x our AVX512-BF16 one), so
the choice is made where the engine runs, family by family, in this order:
1. forced: BULKGEN_NO_KERNEL=1 (pure torch everywhere), `--kernels` / BULKGEN_KERNELS (c, torch, or
   family=path pairs), `--attention-backend`;
2. what the C kernels can take: a library built here, float32 or bfloat16, the bfloat16 linear layers only
   with AVX512-BF16, the linear families only where the lean Llama forward runs;
3. a race of both paths on the model's own shapes (race.py). A few hundred milliseconds, once per machine,
   model shape, dtype and thread count: the result is cached as JSON beside the compiled kernels. The
   faster path runs; a tie goes to C (its linear layers give each row the same bits whatever the batch).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch

from bulkgen.config import KERNEL_FAMILIES, EngineConfig, Paths, parse_kernels
from bulkgen.engine.cpu.kernels import NO_KERNEL_ENV, Kernels, load_cpu_kernels
from bulkgen.engine.cpu.machine import OtherLoad, describe_cpu, others_share_now, torch_capability
from bulkgen.engine.cpu.ops import DTYPE_CODES
from bulkgen.engine.race import race
from bulkgen.errors import ConfigError
from bulkgen.model import ModelShape

log = logging.getLogger(__name__)

KERNELS_ENV = "BULKGEN_KERNELS"  # the --kernels setting for processes started without the flag
CACHE_VERSION = 2
# A race during which other processes used more than this share of the CPUs is cached but not trusted: the
# next engine start that finds the machine quiet (others under half that share for 0.1 s) measures again.
BUSY_SHARE = 0.25


@dataclass(frozen=True)
class FamilyPath:
    use_c: bool
    reason: str


@dataclass(frozen=True)
class CpuPaths:
    kernel: Kernels | None
    families: dict[str, FamilyPath]
    note: str = ""  # how the measured families were measured (now, or when, from the cache)

    def c(self, family: str) -> Kernels | None:
        """The kernel library where `family` runs in C, else None (torch)."""
        return self.kernel if self.families[family].use_c else None

    def short(self) -> str:
        """'C: linear gated_mlp decode_attention; torch: prefill_attention small_ops'"""
        sides = {label: " ".join(name for name, path in self.families.items() if path.use_c == use_c)
                 for label, use_c in (("C", True), ("torch", False))}
        return "; ".join(f"{label}: {names}" for label, names in sides.items() if names)

    def lines(self) -> list[str]:
        return [f"{name}: {'C' if path.use_c else 'torch'} ({path.reason})" for name, path in self.families.items()]

    @classmethod
    def torch_only(cls, reason: str) -> CpuPaths:
        return cls(None, {name: FamilyPath(False, reason) for name in KERNEL_FAMILIES})


def choose(kernel: Kernels | None, dtype: torch.dtype, shape: ModelShape, block_size: int, lean: bool,
           forced: dict[str, str], forced_by: str, no_kernel_reason: str) -> CpuPaths:
    """Each family's path on this machine (see the module docstring for the order of the rules). lean: the
    lean Llama forward runs (llama.py), so the linear families exist."""
    if kernel is None:
        for family, path in forced.items():
            if path == "c":
                raise ConfigError(f"{forced_by} asks for {family} in C, but {no_kernel_reason}")
        return CpuPaths.torch_only(no_kernel_reason)
    families: dict[str, FamilyPath] = {}
    racing = []
    for family in KERNEL_FAMILIES:
        if family in ("linear", "gated_mlp") and not lean:
            families[family] = FamilyPath(False, "not used: the model runs through Hugging Face's modules "
                                                 "(oneDNN linear layers)")
            continue
        why_not = _why_not_c(kernel, family, dtype, shape)
        want = forced.get(family)
        if want == "c" and why_not is not None:
            raise ConfigError(f"{forced_by} asks for {family} in C, but {why_not}")
        if want is not None:
            families[family] = FamilyPath(want == "c", f"forced by {forced_by}")
        elif why_not is not None:
            families[family] = FamilyPath(False, why_not)
        else:
            racing.append(family)
    note = ""
    if racing:
        measured, note = _race_cached(kernel, dtype, shape, block_size, racing, families)
        families.update(measured)
    return CpuPaths(kernel, {name: families[name] for name in KERNEL_FAMILIES}, note)


def paths_for(config: EngineConfig, device: torch.device, dtype: torch.dtype, use_triton: bool, shape: ModelShape,
              lean: bool) -> CpuPaths:
    """C kernels or torch, per kernel family, for an engine: forced by the config or BULKGEN_KERNELS, else
    measured on this machine (choose). Logged at INFO (`bulkgen run -v`)."""
    if device.type != "cpu":
        return CpuPaths.torch_only(f"not on a CPU ({device})")
    if use_triton:
        return CpuPaths.torch_only("Triton kernels in the interpreter (--attention-backend triton)")
    if config.attention_backend == "torch":
        paths = CpuPaths.torch_only("forced by --attention-backend torch")
    else:
        spec, forced_by = config.kernels, f"--kernels {config.kernels}"
        if spec == "auto" and os.environ.get(KERNELS_ENV):
            spec = os.environ[KERNELS_ENV]
            forced_by = f"{KERNELS_ENV}={spec}"
        forced = parse_kernels(spec)
        if config.attention_backend == "kernel":
            forced.update(decode_attention="c", prefill_attention="c")
            forced_by = "--attention-backend kernel" if spec == "auto" else f"{forced_by} --attention-backend kernel"
        if len(forced) == len(KERNEL_FAMILIES) and "c" not in forced.values():
            return CpuPaths.torch_only(f"forced by {forced_by}")
        no_kernel = f"{NO_KERNEL_ENV} is set" if os.environ.get(NO_KERNEL_ENV) \
            else "the C kernels could not be built or loaded here (see the warning above)"
        paths = choose(load_cpu_kernels(), dtype, shape, config.block_size, lean, forced, forced_by, no_kernel)
    log.info("bulkgen: %s; kernel paths%s:", describe_machine(dtype), f" ({paths.note})" if paths.note else "")
    for line in paths.lines():
        log.info("  %s", line)
    return paths


def describe_machine(dtype: torch.dtype) -> str:
    return f"CPU {describe_cpu()} (torch: {torch_capability()}), {str(dtype).removeprefix('torch.')}"


def _why_not_c(kernel: Kernels, family: str, dtype: torch.dtype, shape: ModelShape) -> str | None:
    if family == "sampler":
        return None  # it reads float32 logits, whatever the model's dtype
    if dtype not in DTYPE_CODES:
        return f"the C kernels take float32 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    if family in ("linear", "gated_mlp"):
        if not all(kernel.linear_takes(dtype, k) for k in
                   (shape.hidden, shape.intermediate, shape.num_heads * shape.head_dim)):
            return "the C bfloat16 linear layers need AMX, or AVX512-BF16 and even input sizes"
    return None


def _quiet_now() -> bool:
    share = others_share_now()
    return share is not None and share < BUSY_SHARE / 2


def _race_cached(kernel: Kernels, dtype: torch.dtype, shape: ModelShape, block_size: int, racing: list[str],
                 decided: dict[str, FamilyPath]) -> tuple[dict[str, FamilyPath], str]:
    small_ops_c = decided["small_ops"].use_c if "small_ops" in decided else None
    key_text = json.dumps([CACHE_VERSION, kernel.path.name, torch.__version__, str(dtype), asdict(shape), block_size,
                           torch.get_num_threads(), sorted(racing), bool(small_ops_c)])
    cache_file = Paths().cache_dir / "kernels" / f"paths-{hashlib.sha256(key_text.encode()).hexdigest()[:16]}.json"
    try:
        timings = json.loads(cache_file.read_text())
        if timings.get("_busy", 0.0) > BUSY_SHARE and _quiet_now():
            raise ValueError("measured on a busy machine, and this one is idle now: measure again")
        note = f"measured on this machine {timings.pop('_measured_at')} (cached in {cache_file})"
    except (OSError, ValueError, KeyError):
        started = time.perf_counter()
        with OtherLoad() as load:
            timings = race(kernel, dtype, shape, block_size, racing, small_ops_c)
        note = f"measured on this machine now, in {time.perf_counter() - started:.2f} s"
        busy = load.share or 0.0
        if busy > BUSY_SHARE:
            note += f", while other processes used {busy:.0%} of its CPUs (measured again once it is idle)"
            log.info("bulkgen: the kernel paths were measured while other processes used %.0f%% of the CPUs; "
                     "they are measured again once it is idle", 100 * busy)
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**timings, "_measured_at": time.strftime("%Y-%m-%d %H:%M"),
                                       "_busy": round(busy, 3)}))
            os.replace(tmp, cache_file)
        except OSError as exc:
            log.warning("bulkgen: could not cache the kernel timings in %s (%s)", cache_file, exc)
    timings.pop("_busy", None)
    out = {}
    for family in racing:
        c_s, torch_s = timings[family]
        with_ = kernel.linear_name(dtype) if family in ("linear", "gated_mlp") else ""
        c = f"C ({with_})" if with_ else "C"
        faster = f"{c} {torch_s / c_s:.2f}x torch" if c_s <= torch_s else f"torch {c_s / torch_s:.2f}x {c}"
        out[family] = FamilyPath(c_s <= torch_s,
                                 f"measured: {faster}, {c_s * 1e6:.1f} vs {torch_s * 1e6:.1f} us a token")
    return out, note

"""How a model will run, then the model loaded so: `plan` chooses the device, the weights' dtype and quantization
(auto: what fits in memory, engine/memory.py) and the backend before anything is read (the engine makes the plan
and hands it down: the config goes one way); `load` (the runner's first phase) reads the weights, from Hugging
Face's from_pretrained, a GGUF file's blocks (gguf_load.py) or, for --quantization int8, safetensors quantized as
they are read (int8_load.py), checked for what bulkgen computes (probe.check_loaded).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from bulkgen.config import DTYPES, EngineConfig, parse_kernels
from bulkgen.engine import memory
from bulkgen.engine.attention import register
from bulkgen.engine.cpu.kernels import load_cpu_kernels
from bulkgen.engine.cpu.machine import check_dtype_fits, keep_freed_memory
from bulkgen.engine.gguf_load import load_gguf, weight_kinds
from bulkgen.engine.int8_load import load_int8
from bulkgen.engine.metadata import ATTENTION_NAME
from bulkgen.engine.probe import check_loaded
from bulkgen.errors import ConfigError, ModelError
from bulkgen.gguf_info import GGUFInfo
from bulkgen.model import HF_LOAD_LOCK

log = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES, as torch names them


@dataclass(frozen=True)
class Plan:
    config: EngineConfig  # its dtype and quantization as they run (auto resolved)
    device: torch.device
    triton: bool  # attention, the KV write and the small ops in Triton (a GPU, or Triton's interpreter)
    gguf: GGUFInfo | None  # the model's GGUF file, where it came from one

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.config.dtype]


def plan(model: str | Path | torch.nn.Module, config: EngineConfig) -> Plan:
    """How the model runs: its device, backend, dtype and quantization, every choice checked before any weight is
    read."""
    device = _device(config.device)
    triton = _use_triton(device, config.attention_backend)
    quantization, dtype, gguf = _plan(model, config, device.type == "cuda")
    if device.type == "cpu":
        check_dtype_fits(dtype)
    return Plan(dataclasses.replace(config, dtype=dtype, quantization=quantization), device, triton, gguf)


def load(model: str | Path | torch.nn.Module, plan: Plan) -> tuple[torch.nn.Module, Counter]:
    """The model on its device, in the plan's dtype and quantization; and its linear layers' GGUF types
    (--quantization gguf), read before the lean forward takes them."""
    config, device, dtype = plan.config, plan.device, plan.dtype
    if device.type == "cpu":
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()
    if plan.gguf is not None and config.quantization == "gguf":  # the linear layers in the file's own blocks
        in_c = device.type == "cpu" and not plan.triton \
            and parse_kernels(config.kernels).get("linear") != "torch"  # as the int8 layers choose
        blocks_kernel = load_cpu_kernels() if in_c else None
        loaded = check_loaded(load_gguf(plan.gguf.gguf, Path(model), dtype, blocks_kernel)).to(device)
    elif config.quantization == "int8" and not isinstance(model, torch.nn.Module):
        loaded = _int8(Path(model), plan)
    else:
        loaded = _from_pretrained(model, dtype, device)
    return loaded, weight_kinds(loaded)


def _from_pretrained(model: str | Path | torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # here: transformers loads on a model's first load
    from transformers.utils import logging as hf_logging

    register()
    if isinstance(model, torch.nn.Module):
        loaded = model
        loaded.set_attn_implementation(ATTENTION_NAME)
    else:
        hf_logging.disable_progress_bar()
        try:
            with HF_LOAD_LOCK:
                loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype,
                                                              attn_implementation=ATTENTION_NAME)
        except KeyError as exc:
            if exc.args == (ATTENTION_NAME,):  # the class looks attention up in a table of its own
                raise ModelError(f"cannot load model {model}: its transformers class does not take an attention "
                                 "function through transformers' attention interface, so bulkgen cannot plug its "
                                 "paged attention into it") from exc
            raise ModelError(f"cannot load model {model}: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load model {model}: {exc}") from exc
    return check_loaded(loaded).to(device=device, dtype=dtype).eval()


def _int8(model_dir: Path, plan: Plan) -> torch.nn.Module:
    """--quantization int8 from a directory: its linear layers quantized as they are read (int8_load.py), so the
    load's peak is about the int8 weights; where the checkpoint is not laid out for that, a float load that the
    runner quantizes after, if the float weights fit (ConfigError with the numbers before reading any)."""
    loaded, why_not = load_int8(model_dir, plan.dtype)
    if loaded is not None:
        return check_loaded(loaded).to(plan.device)
    config = plan.config
    try:
        memory.dtype_for(config.dtype, model_dir, config.kv_cache_memory, plan.device.type == "cuda")
    except ConfigError as exc:
        raise ConfigError(f"--quantization int8 loads {model_dir.name} in {config.dtype} before quantizing it "
                          f"({why_not}), and {exc}") from exc
    log.info("bulkgen: --quantization int8 loads %s in %s first (%s), then quantizes it", model_dir.name,
             config.dtype, why_not)
    return _from_pretrained(model_dir, plan.dtype, plan.device)


def _use_triton(device: torch.device, backend: str) -> bool:
    """Triton on a GPU (unless --attention-backend torch); on CPU only when asked, in the interpreter."""
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ConfigError("--attention-backend triton runs Triton's GPU kernels; on a CPU only in Triton's "
                          "interpreter (TRITON_INTERPRET=1, for tests): use auto, kernel or torch here")
    wanted = backend == "triton" or (device.type == "cuda" and backend == "auto")
    if not wanted:
        return False
    try:
        import triton  # noqa: F401  (ships with every CUDA build of torch)
    except ImportError as exc:
        if backend == "triton":
            raise ConfigError("--attention-backend triton needs the triton package (pip install triton)") from exc
        log.warning("bulkgen: triton is not installed; attention runs in torch (slower on a GPU)")
        return False
    return True


def _plan(model: str | Path | torch.nn.Module, config: EngineConfig,
          on_gpu: bool) -> tuple[str, str, GGUFInfo | None]:
    """--quantization and --dtype as they run (memory.run_plan), for a model given as a module too."""
    if not isinstance(model, torch.nn.Module):
        return memory.run_plan(Path(model), config, on_gpu)
    if config.quantization == "gguf":
        raise ConfigError(f"--quantization gguf runs a GGUF file's own blocks, and {type(model).__name__} did not "
                          "come from one: give a .gguf file, the default model, or a hub name with :QUANT (or use "
                          "--quantization int8)")
    num_weights = sum(p.numel() for p in model.parameters())
    dtype = memory.choose_dtype(config.dtype, num_weights, config.kv_cache_memory, memory.available_memory(),
                                memory.native_dtypes(), on_gpu, type(model).__name__)
    return ("none" if config.quantization == "auto" else config.quantization), dtype, None


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no GPU; use --device cpu")
    return device

"""A model straight from a GGUF file, its linear layers kept in the file's blocks (`--quantization gguf`).

The model is built from its config without initializing its weights (the float copies of the linear layers
are allocated but never written, so they take no memory, and are dropped once replaced). Every tensor of the
file is then read once: a linear layer's weight in Q8_0, Q4_0, Q4_1, Q4_K or Q6_K becomes a GGUFLinear on its
own blocks (engine/blocks.py); one in another quantized type is dequantized and requantized to Q8_0 blocks (a
line says so); one the file holds in float stays float; every other tensor (embeddings, norms) is dequantized
into the model. Names and the row order of Llama's q and k follow transformers' own GGUF loader (its tensor
name map and tensor processors), so the model equals the one `--quantization none` loads, but for the blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bulkgen.engine.attention import register
from bulkgen.engine.blocks import BLOCK_VALUES, FORMATS, Blocks, GGUFLinear, decode
from bulkgen.engine.cpu.kernels import Kernels
from bulkgen.engine.metadata import ATTENTION_NAME
from bulkgen.errors import ModelError
from bulkgen.gguf_info import FLOAT_TYPES
from bulkgen.model import HF_LOAD_LOCK

log = logging.getLogger(__name__)

def load_gguf(gguf: Path, config_dir: Path, dtype: torch.dtype, kernel: Kernels | None) -> torch.nn.Module:
    from gguf import GGUFReader
    from gguf.quants import dequantize, quantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

    try:
        reader = GGUFReader(gguf)
        arch = str(reader.fields["general.architecture"].contents())
    except Exception as exc:  # a damaged or foreign file fails in the reader in many ways
        raise ModelError(f"cannot read GGUF file {gguf}: {exc}") from exc
    processor_class = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if processor_class not in (TensorProcessor, LlamaTensorProcessor):  # they reshape more than rows
        raise ModelError(f"--quantization gguf does not keep the blocks of {arch} models yet; "
                         "use --quantization none")
    register()
    config = AutoConfig.from_pretrained(config_dir)
    with HF_LOAD_LOCK, no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    processor = processor_class(config=config.to_dict())
    names = _tensor_names(model, arch, config.num_hidden_layers)
    modules = dict(model.named_modules())
    state = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    linears: dict[str, Blocks | torch.Tensor] = {}
    requantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None or hf_name not in state:
            continue
        kind = tensor.tensor_type.name
        owner, _, attr = hf_name.rpartition(".")
        module = modules.get(owner)
        data = np.asarray(tensor.data)
        if attr == "weight" and type(module) is torch.nn.Linear and kind not in FLOAT_TYPES:
            rows = _row_order(processor, tensor.name, module.out_features)
            k = module.in_features
            if kind in FORMATS and k % BLOCK_VALUES[kind] == 0 and (kernel is None or kernel.qblocks_takes(
                    fmt=FORMATS[kind], K=k)):
                linears[owner] = decode(data[rows], kind, k)
            else:  # a type without a kernel here: its values in Q8_0 blocks
                values = dequantize(data, tensor.tensor_type).reshape(module.out_features, k)[rows]
                linears[owner] = decode(quantize(values, _q8_0()), "Q8_0", k)
                requantized[kind] += 1
            loaded.add(hf_name)
            continue
        values = processor.process(weights=dequantize(data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters={"tensors": {}}).weights
        target = state[hf_name]
        if values.size != target.numel():
            raise ModelError(f"GGUF tensor {tensor.name} has {values.size} values; the model's {hf_name} "
                             f"takes {target.numel()}")
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.array(values, copy=True)).reshape(target.shape))
        if attr == "weight" and type(module) is torch.nn.Linear:
            linears[owner] = target.detach()
        loaded.add(hf_name)
    if config.tie_word_embeddings:
        model.tie_weights()
        head = model.get_output_embeddings()
        loaded |= {f"{name}.weight" for name, module in modules.items() if module is head}
    missing = [name for name in state if name not in loaded and not name.endswith("inv_freq")]
    if missing:
        raise ModelError(f"GGUF file {gguf} holds no tensor for {', '.join(missing[:4])}"
                         f"{' …' if len(missing) > 4 else ''}")
    for owner, weight in linears.items():
        parent, _, child = owner.rpartition(".")
        module = modules[owner]
        setattr(modules[parent], child, GGUFLinear(weight, module.bias, kernel))
    for kind, count in sorted(requantized.items()):
        log.warning("bulkgen: %d linear layers of %s are %s, which --quantization gguf has no kernel for: their "
                    "weights are requantized to Q8_0 blocks at load", count, gguf.name, kind)
    model.config._name_or_path = str(config_dir)
    return model.eval()


def _tensor_names(model: torch.nn.Module, arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> the model's own, by gguf's tensor name map (as transformers' GGUF loader maps them,
    without its walk that rebuilds the map for every submodule: seconds a load)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_key = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_key is None:
        raise ModelError(f"the gguf package does not know architecture {arch!r}")
    name_map = get_tensor_name_map(arch_key, num_layers)
    out: dict[str, str] = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        parts = base.split(".")
        for i in range(len(parts)):  # "model.layers.0.mlp.up_proj", then without its first parts
            gguf_name = name_map.get_name(".".join(parts[i:]))
            if gguf_name is not None:
                out.setdefault(f"{gguf_name}.{suffix}", hf_name)
                break
    return out


def _row_order(processor: object, name: str, rows: int) -> np.ndarray:
    """The permutation transformers' tensor processor applies to this tensor's rows (Llama's q and k are stored
    in llama.cpp's rotary order): found by processing the row numbers themselves."""
    order = processor.process(weights=np.arange(rows)[:, None], name=name, tensor_key_mapping={},
                              parsed_parameters={"tensors": {}}).weights.reshape(-1)
    if not np.array_equal(np.sort(order), np.arange(rows)):
        raise ModelError(f"GGUF tensor {name}: transformers reorders more than its rows; keep its blocks "
                         "with --quantization none instead")
    return order


def weight_kinds(model: torch.nn.Module) -> Counter[str]:
    """How many linear layers hold each type (Q4_K, Q6_K, float32, ...)."""
    return Counter(kind for m in model.modules() if isinstance(m, GGUFLinear) for kind in m.linear.kinds())


def _q8_0() -> object:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType.Q8_0

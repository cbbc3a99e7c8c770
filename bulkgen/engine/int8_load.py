"""A model of safetensors weights with its linear layers quantized as they are read (`--quantization int8`).

As gguf_load.py does for a GGUF file: the model is built from its config without initializing its weights (the
float copies are allocated but never written, so they take no memory, and are dropped once replaced). Each
tensor of the checkpoint is then read once, by plain reads rather than through a memory map (a mapped file's
pages would count as the process's own until it closed): the weight of every nn.Linear but the output head is
rounded to the model's dtype, as from_pretrained would load it, and quantized at once (quant.quantize_rows, a
few thousand rows at a time) into a QuantizedLinear; every other tensor is copied into the model in its dtype.
So the load holds at most one linear layer's float weight beside the int8 ones: its peak is about the int8
weights and the float embeddings, not the float model, and the weights equal those of quantizing after a float
load, bit for bit.

Where the checkpoint is not laid out as the model's own modules name their weights (keys transformers renames
at load, .bin files, modules kept in float32, an already quantized checkpoint), `load_int8` returns None with
the reason, and loading.py loads in float and quantizes after.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bulkgen.engine.attention import register
from bulkgen.engine.cpu.machine import release_freed_memory
from bulkgen.engine.metadata import ATTENTION_NAME
from bulkgen.engine.quant import QuantizedLinear, quantize_weight
from bulkgen.errors import ModelError
from bulkgen.model import HF_LOAD_LOCK, checkpoint_files, safetensors_header

# safetensors' dtype names (its format's specification)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def load_int8(model_dir: Path, dtype: torch.dtype) -> tuple[torch.nn.Module | None, str]:
    """The model with its linear layers (all but the output head) as QuantizedLinear, on the CPU; or None and why
    it cannot be loaded so (module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    files = checkpoint_files(model_dir)
    if files is None:
        return None, "its weights are not in safetensors files"
    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "quantization_config", None):
        return None, "its checkpoint is quantized already"
    tensors = {key: (path, start, entry) for path in files for start, header in [safetensors_header(path)]
               for key, entry in header.items() if key != "__metadata__"}
    register()
    with HF_LOAD_LOCK, no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    if dtype != torch.float32 and (model._keep_in_fp32_modules or getattr(model, "_keep_in_fp32_modules_strict", None)):
        return None, "its class keeps some modules in float32"
    model.to(dtype)  # its buffers, as the float load converts them (the unwritten weights are in dtype already)
    model.tie_weights()
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:  # tied: the embeddings' values
        tensors.pop(next(f"{name}.weight" for name, m in modules.items() if m is head), None)
    state = model.state_dict(keep_vars=True)
    owner_of = {id(t): key for key, t in state.items() if key in tensors}  # a tied weight: its checkpoint key
    missing = [key for key, t in state.items() if key not in tensors and id(t) not in owner_of]
    unexpected = [key for key in tensors if key not in state]
    if missing or unexpected:
        names = (missing or unexpected)[:3]
        return None, f"its checkpoint's names are not its modules' ({'missing' if missing else 'unexpected'}: " \
                     f"{', '.join(names)})"
    wrong = [key for key, (_, _, entry) in tensors.items() if list(entry["shape"]) != list(state[key].shape)]
    if wrong:
        return None, f"its checkpoint's {wrong[0]} is not shaped as its module's"
    linears = {f"{name}.weight": name for name, m in modules.items() if type(m) is torch.nn.Linear and m is not head}
    for key, owner in linears.items():  # their float weights are never written: their memory goes back unwritten
        module = modules[owner]
        module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
        state[key] = module.weight
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for path in files:
            entries = sorted(((key, entry) for key, (p, _, entry) in tensors.items() if p == path),
                             key=lambda item: item[1]["data_offsets"][0])
            start = tensors[entries[0][0]][1] if entries else 0
            # read straight into the model where its tensor has the file's dtype; else (and a linear layer's
            # weight) into one buffer, reused: no float copy of a tensor outlives its turn
            direct = {key for key, entry in entries if key not in linears and DTYPES.get(entry["dtype"]) ==
                      state[key].dtype and state[key].is_contiguous()}
            buffer = torch.empty(max((_nbytes(e) for key, e in entries if key not in direct), default=0),
                                 dtype=torch.uint8)
            value = None
            with open(path, "rb") as f:
                for key, entry in entries:
                    if key in direct:
                        _read(f, path, start, entry, state[key].detach().view(-1).view(torch.uint8))
                        continue
                    value = _read(f, path, start, entry, buffer)
                    if key in linears:
                        quantized[linears[key]] = quantize_weight(value.to(dtype))
                        release_freed_memory()  # the heap's free pages its temporaries wrote: RSS stays put
                    else:
                        state[key].copy_(value)
            del buffer, value
    del state
    for owner, (q, scale) in quantized.items():
        parent, _, child = owner.rpartition(".")
        setattr(modules[parent], child, QuantizedLinear(q, scale, modules[owner].bias))
    if model.can_generate() and (model_dir / "generation_config.json").is_file():  # as from_pretrained reads it
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.config._name_or_path = str(model_dir)
    return model.eval(), ""


def _nbytes(entry: dict) -> int:
    begin, end = entry["data_offsets"]
    return end - begin


def _read(f: object, path: Path, start: int, entry: dict, buffer: torch.Tensor) -> torch.Tensor:
    """One tensor of an open safetensors file, read into the front of buffer (bytes; it then views them)."""
    begin, end = entry["data_offsets"]
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ModelError(f"{path.name}: a tensor of dtype {entry['dtype']}, which bulkgen does not read")
    data = buffer[:end - begin]
    f.seek(start + begin)
    if f.readinto(data.numpy()) != end - begin:
        raise ModelError(f"{path.name} ends inside its tensors: the file is cut short")
    return data.view(dtype).reshape(entry["shape"])

"""What bulkgen knows of a model from its config, without its weights: its shape (layers, heads, KV
bytes per token, the attention type of each layer), its limits (context, sliding window) and its
tokenizer. `resolve.py` turns a name into a directory; everything else asks here, so that submit,
the engine, the CPU paths, the bench and export agree.

No torch here: a shape is read off any object with a Hugging Face config's attributes.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkgen.errors import ModelError

# transformers' from_pretrained swaps PreTrainedModel.tie_weights for a no-op while it loads and sets it back after
# (initialization.no_tie_weights), on the class: two loads in two threads of one process can leave the no-op there
# for good, and every later model with tied embeddings then loads with its output layer uninitialized (seen: two
# workers in one process, then the default model's lm_head random, or on the meta device). bulkgen loads a model
# only while holding this lock.
HF_LOAD_LOCK = threading.Lock()

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # config.DTYPES, as stored in the KV cache


@dataclass(frozen=True)
class ModelShape:
    """The sizes that the KV cache, the kernels' races and the roofline are computed from."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention", one a layer
    window: int = 0  # the sliding layers' window (0: none slides)

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """The shape a Hugging Face config (or anything with its attributes) states."""
        config = text_config(config)
        num_heads = config.num_attention_heads
        hidden = config.hidden_size
        num_layers = config.num_hidden_layers
        window = sliding_window(config)
        layer_types = getattr(config, "layer_types", None) or \
            ["sliding_attention" if window is not None else "full_attention"] * num_layers
        return cls(num_layers=num_layers, hidden=hidden,
                   intermediate=getattr(config, "intermediate_size", None) or 4 * hidden,
                   num_heads=num_heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
                   head_dim=getattr(config, "head_dim", None) or hidden // num_heads,
                   vocab=config.vocab_size, layer_types=tuple(layer_types), window=window or 0)

    @property
    def windows(self) -> tuple[int, ...]:
        """Per layer, the positions it attends to: its sliding window, or 0 for the whole context."""
        return tuple(self.window if kind == "sliding_attention" else 0 for kind in self.layer_types)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V that one token holds, over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def text_config(config: Any) -> Any:
    """The language model's part of a config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(config: Any, name: str) -> int:
    """The longest sequence (prompt + output) the model was trained for."""
    config = text_config(config)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelError(f"cannot tell the context length of {name}: its config has no max_position_embeddings")


def sliding_window(config: Any) -> int | None:
    """The window over which some of the model's layers attend (None: every layer attends to the whole
    context), read as transformers reads it: from `layer_types` where the config has them, else from
    `sliding_window` unless `use_sliding_window` is off. Every attention path computes it per layer
    (engine/metadata.LayerAttention)."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) is not False else None


def checkpoint_files(model_dir: Path) -> list[Path] | None:
    """The safetensors files from_pretrained reads (those its index names, else model.safetensors, else every
    *.safetensors file); None where the directory has none (a .bin checkpoint)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [model_dir / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"cannot read {index}: {exc}") from exc
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    return sorted(model_dir.glob("*.safetensors")) or None


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data starts, and its header: name -> dtype, shape, data_offsets (and
    __metadata__)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the weights file {path}: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelError(f"cannot read the weights file {path}: its header is not a table of tensors")
    return 8 + size, header


def weight_count(model_dir: Path, vocab: int | None = None) -> int | None:
    """The number of weights in a model directory's safetensors files (their headers only: no tensor is read),
    or None where it holds none (a .bin checkpoint: the caller estimates from the shape). vocab: count only the
    linear layers' weights (every 2-D weight whose rows or columns are not the vocabulary's: the embeddings
    and the output head are not counted)."""
    files = checkpoint_files(model_dir)
    if files is None:
        return None
    total = 0
    for path in files:
        for key, t in safetensors_header(path)[1].items():
            if key == "__metadata__":
                continue
            shape = t["shape"]
            if vocab is None or (key.endswith(".weight") and len(shape) == 2 and vocab not in shape):
                total += math.prod(shape)
    return total


def estimated_weight_count(shape: ModelShape) -> int:
    """About how many weights a dense model of this shape has (untied embeddings, gated MLP): where no
    safetensors header says."""
    attention = shape.hidden * shape.head_dim * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    mlp = 3 * shape.hidden * shape.intermediate
    return shape.num_layers * (attention + mlp) + 2 * shape.vocab * shape.hidden


def read_config(model_dir: Path) -> Any:
    """The model directory's Hugging Face config."""
    from transformers import AutoConfig  # here, not at the top: transformers is slow to import

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the config of {model_dir}: {exc}") from exc


def limits(model_dir: Path) -> int:
    """The model's context length."""
    return context_length(read_config(model_dir), str(model_dir))


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The model's chat template applied to messages, ready for the assistant's turn: the one call of it
    (submit, the in-memory stage and the bench's workloads render here). ValueError with the template's
    words where it fails."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # a template may raise anything on messages it rejects
        raise ValueError(f"chat template failed: {exc}") from exc


# a tokenizer's own files: one of them is there wherever transformers can load one from a directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


def load_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer: the one way submit, the engine and export load it."""
    from transformers import AutoTokenizer  # here, not at the top: transformers is slow to import

    model_dir = Path(model_dir)
    if model_dir.is_dir() and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"{model_dir} has no tokenizer (tokenizer.json / tokenizer_config.json): copy the "
                         "model's tokenizer files beside its config.json")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # a tokenizer's files can fail in many ways
        raise ModelError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc

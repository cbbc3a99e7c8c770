"""What a model converted from a GGUF file takes with its linear layers kept in the file's blocks
(`--quantization gguf`, engine/gguf_load.py): read once from the file at conversion (resolve.py) and kept beside
the converted model. No torch here: the decision to keep the blocks is arithmetic on sizes (engine/memory.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from bulkgen.errors import ModelError

FLOAT_TYPES = ("F32", "F16", "BF16")
INFO_FILE = "bulkgen-gguf.json"  # in a model directory converted from a GGUF file (resolve.py): GGUFInfo


@dataclass(frozen=True)
class GGUFInfo:
    """A converted model directory's GGUF file, and what its tensors take kept in blocks."""

    gguf: Path
    block_bytes: int  # the quantized matrices (the linear layers), as the file stores them
    float_values: int  # everything else (embeddings, norms, float matrices), loaded in the model's dtype
    block_values: int  # the values the blocks hold
    weights: bool  # whether the directory also holds the dequantized weights (--quantization none)

    @staticmethod
    def of_file(gguf: Path, weights: bool) -> GGUFInfo:
        from gguf import GGUFReader

        try:
            tensors = GGUFReader(gguf).tensors
        except Exception as exc:  # a damaged or foreign file fails in the reader in many ways
            raise ModelError(f"cannot read GGUF file {gguf}: {exc}") from exc
        blocks = [t for t in tensors if _kept_in_blocks(t.name, t.tensor_type.name, len(t.shape))]
        block_values = sum(int(t.n_elements) for t in blocks)
        return GGUFInfo(gguf.resolve(), sum(int(t.n_bytes) for t in blocks),
                        sum(int(t.n_elements) for t in tensors) - block_values, block_values, weights)

    def save(self, model_dir: Path) -> None:
        (model_dir / INFO_FILE).write_text(json.dumps({**dataclasses.asdict(self), "gguf": str(self.gguf)}) + "\n")

    def bytes_in(self, dtype_bytes: int) -> int:
        """The weights' bytes with the blocks kept (about 6 % more for the K-quants' repacking)."""
        return int(self.block_bytes * BLOCKS_OVERHEAD) + self.float_values * dtype_bytes


BLOCKS_OVERHEAD = 1.06  # qblocks.c's layout against the file's bytes, at most (Q4_K: 152 / 144)


def _kept_in_blocks(name: str, kind: str, dims: int) -> bool:
    return dims == 2 and kind not in FLOAT_TYPES and not name.startswith("token_embd")


def gguf_info(model_dir: Path) -> GGUFInfo | None:
    """What the directory's GGUF file takes (None: the model did not come from a GGUF file, or the file is
    gone). Directories converted before INFO_FILE existed name their file in .bulkgen-complete: measured
    once then."""
    info_file = model_dir / INFO_FILE
    if info_file.is_file():
        data = json.loads(info_file.read_text())
        info = GGUFInfo(Path(data["gguf"]), int(data["block_bytes"]), int(data["float_values"]),
                        int(data["block_values"]), bool(data["weights"]))
        return info if info.gguf.is_file() else None
    marker = model_dir / ".bulkgen-complete"
    text = marker.read_text().strip() if marker.is_file() else ""
    if not text.startswith("converted from ") or not Path(text.removeprefix("converted from ")).is_file():
        return None
    info = GGUFInfo.of_file(Path(text.removeprefix("converted from ")), weights=True)
    try:
        info.save(model_dir)
    except OSError:  # a read-only directory: measured again next time
        pass
    return info

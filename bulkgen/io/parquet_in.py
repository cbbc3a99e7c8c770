"""Reading a job's input: a Parquet file checked up front, then streamed in record batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bulkgen.errors import InputError

BATCH_ROWS = 2048


@dataclass(frozen=True)
class InputColumns:
    """Which input columns feed the job. Exactly one of prompt / messages is set."""

    prompt: str | None = None
    messages: str | None = None
    id: str | None = None
    max_new_tokens: str | None = None  # per-row token budget, overriding --max-new-tokens

    @property
    def needed(self) -> list[str]:
        names = [self.prompt, self.messages, self.id, self.max_new_tokens]
        return list(dict.fromkeys(n for n in names if n is not None))


class InputFile:
    """An opened, validated Parquet input. Nothing is read beyond the footer until `batches()`."""

    def __init__(self, path: Path, columns: InputColumns) -> None:
        self.path = Path(path).expanduser().resolve()
        self.columns = columns
        if not self.path.exists():
            raise InputError(f"input file {path} does not exist")
        if self.path.is_dir():
            raise InputError(f"input {path} is a directory: give a .parquet file")
        try:
            self._file = pq.ParquetFile(self.path, pre_buffer=False)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{path} is not a Parquet file ({exc}); convert it, e.g. with "
                             "pandas.read_csv(...).to_parquet(...)") from exc
        self.schema = self._file.schema_arrow
        self.num_rows = self._file.metadata.num_rows
        self._check_schema()
        if self.num_rows == 0:
            raise InputError(f"{path} has no rows: nothing to submit")

    @property
    def column_names(self) -> list[str]:
        return list(self.schema.names)

    @property
    def fingerprint(self) -> str:
        stat = self.path.stat()
        return f"size={stat.st_size};mtime_ns={stat.st_mtime_ns}"

    def batches(self, batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """Only the needed columns, a batch at a time: memory stays flat whatever the file size."""
        yield from self._file.iter_batches(batch_size=batch_rows, columns=self.columns.needed)

    def _check_schema(self) -> None:
        available = self.column_names
        for flag, name in (("--prompt-column", self.columns.prompt), ("--messages-column", self.columns.messages),
                           ("--id-column", self.columns.id), ("--max-new-tokens-column", self.columns.max_new_tokens)):
            if name is not None and name not in available:
                raise InputError(f"{self.path.name} has no column {name!r} ({flag}); its columns are: "
                                 f"{', '.join(available)}")
        if self.columns.prompt is not None:
            kind = self.schema.field(self.columns.prompt).type
            if not _is_text_type(kind):
                raise InputError(f"column {self.columns.prompt!r} holds {kind}, not text: --prompt-column needs a "
                                 "string column (use --messages-column for chat messages)")
        if self.columns.messages is not None:
            kind = self.schema.field(self.columns.messages).type
            if not _is_messages_type(kind):
                raise InputError(f"column {self.columns.messages!r} holds {kind}: --messages-column needs a list of "
                                 "{role: string, content: string} structs")
        if self.columns.max_new_tokens is not None:
            kind = self.schema.field(self.columns.max_new_tokens).type
            if not pa.types.is_integer(kind):
                raise InputError(f"column {self.columns.max_new_tokens!r} holds {kind}: --max-new-tokens-column "
                                 "needs an integer column")
        if self.columns.id is not None:
            kind = self.schema.field(self.columns.id).type
            if pa.types.is_nested(kind):
                raise InputError(f"column {self.columns.id!r} holds {kind}: --id-column needs a scalar column "
                                 "(string or integer)")


def _is_text_type(kind: pa.DataType) -> bool:
    """Strings, large strings, and dictionary-encoded strings (what pandas writes for a categorical)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _is_messages_type(kind: pa.DataType) -> bool:
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    item = kind.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name for i in range(item.num_fields)}
    return {"role", "content"} <= names

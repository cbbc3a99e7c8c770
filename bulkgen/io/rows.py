"""Row files in: Parquet, JSONL (one object a line, columns as keys) and CSV, each streamed in record batches
through pyarrow, behind one interface: a schema known up front (Parquet's footer; the first block of a
JSONL or CSV file), batches of the columns asked for, a fingerprint for export to check.

The format comes from the file name (.parquet, .jsonl / .ndjson, .csv), else from its first bytes; a JSONL
file whose first line is an OpenAI batch request (custom_id, method, url, body) is format "openai"
(io/openai_batch.py reads those).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from bulkgen.errors import InputError

INPUT_FORMATS = ("auto", "parquet", "jsonl", "csv", "openai")
SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
OPENAI_KEYS = frozenset({"custom_id", "method", "url", "body"})
BLOCK_BYTES = 4 << 20  # a JSONL/CSV block: its rows are one batch
BATCH_ROWS = 2048


def detect_format(path: Path, forced: str = "auto") -> str:
    """parquet, jsonl, csv or openai: `forced` unless auto, else by suffix (and a JSONL file's first line),
    else by the first bytes."""
    if forced != "auto":
        if forced not in INPUT_FORMATS:
            raise InputError(f"unknown input format {forced!r}: one of {', '.join(INPUT_FORMATS)}")
        return forced
    kind = SUFFIXES.get(path.suffix.lower())
    if kind == "parquet" or kind == "csv":
        return kind
    with open(path, "rb") as handle:
        head = handle.read(4)
    if kind is None and head == b"PAR1":
        return "parquet"
    first = _first_line(path)
    if first is not None and first.lstrip().startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            # custom_id and one of method/url/body: a batch file (a line missing the rest is its error)
            return "openai" if "custom_id" in obj and len(OPENAI_KEYS & obj.keys()) >= 2 else "jsonl"
    if kind == "jsonl":
        return "jsonl"  # its first line is bad: reading it says where
    raise InputError(f"cannot tell the format of {path.name}: name it .parquet, .jsonl or .csv, or give "
                     "--input-format parquet|jsonl|csv|openai")


def fingerprint(path: Path) -> str:
    """What export checks to tell that an input file is the one submitted (its size and modification time)."""
    stat = path.stat()
    return f"size={stat.st_size};mtime_ns={stat.st_mtime_ns}"


def _first_line(path: Path) -> str | None:
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                return line
    return None


class RowFile:
    """A Parquet, JSONL or CSV file of rows. `text_columns` are read as text whatever a CSV's values look
    like (a column of numbers is still prompts); `int_columns` as integers."""

    def __init__(self, path: Path, fmt: str, text_columns: Iterable[str] = (), int_columns: Iterable[str] = ()) -> None:
        self.path = path
        self.format = fmt
        self._text, self._ints = set(text_columns), set(int_columns)
        self.num_rows: int | None = None  # known up front for Parquet only
        if fmt != "parquet" and _first_line(path) is None:
            raise InputError(f"{path.name} has no rows: nothing to submit")
        try:
            if fmt == "parquet":
                self._parquet = pq.ParquetFile(path, pre_buffer=False)
                self.schema = self._parquet.schema_arrow
                self.num_rows = self._parquet.metadata.num_rows
            else:
                reader = self._open()
                self.schema = reader.schema
        except (pa.ArrowInvalid, OSError, ValueError) as exc:
            raise InputError(self._unreadable(exc)) from exc

    def _unreadable(self, exc: BaseException) -> str:
        if self.format != "parquet" and (where := _first_bad_line(self.path, self.format)) is not None:
            return where
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        advice = {"parquet": "convert it, e.g. with pandas.read_csv(...).to_parquet(...)",
                  "jsonl": "each line must be one JSON object with the same keys and value types",
                  "csv": "it needs a header line, then rows of comma-separated values (quote values with commas)"}
        name = {"parquet": "Parquet", "jsonl": "JSONL", "csv": "CSV"}[self.format]
        return f"{self.path.name} is not a Parquet file ({text}); {advice[self.format]}" if self.format == "parquet" \
            else f"{self.path.name} is not a readable {name} file ({text}); {advice[self.format]}"

    def _open(self):
        if self.format == "jsonl":
            # the schema of the first block holds for the file: keys first seen later are left out (a
            # streamed read cannot add a column half-way), a value of another type refuses the file
            known = getattr(self, "schema", None)
            options = pa_json.ParseOptions(explicit_schema=known, unexpected_field_behavior="ignore") \
                if known is not None else pa_json.ParseOptions()
            return pa_json.open_json(self.path, read_options=pa_json.ReadOptions(block_size=BLOCK_BYTES),
                                     parse_options=options)
        header = self._csv_header
        types = {name: pa.string() for name in self._text if name in header}
        types.update({name: pa.int64() for name in self._ints if name in header})
        return pa_csv.open_csv(self.path, read_options=pa_csv.ReadOptions(block_size=BLOCK_BYTES),
                               convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=True))

    @functools.cached_property
    def _csv_header(self) -> list[str]:
        """The CSV's column names (read once: every open forces types by name)."""
        reader = pa_csv.open_csv(self.path, read_options=pa_csv.ReadOptions(block_size=1 << 16))
        return reader.schema.names

    @property
    def column_names(self) -> list[str]:
        return list(self.schema.names)

    def batches(self, columns: list[str] | None, batch_rows: int) -> Iterator[pa.RecordBatch]:
        """The columns asked for (None: all), in batches of about batch_rows rows; memory stays flat."""
        if self.format == "parquet":
            yield from self._parquet.iter_batches(batch_size=batch_rows, columns=columns)
            return
        reader = self._open()
        try:
            for batch in reader:
                batch = batch.select(columns) if columns is not None else batch
                for start in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(start, batch_rows)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(self._unreadable(exc)) from exc


def _first_bad_line(path: Path, fmt: str) -> str | None:
    """Where a JSONL or CSV file that failed to read goes wrong, said as its line number and start (the file is
    read again line by line: only on the way to an error), or None where every line looks right."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return (f"{path.name} line {number} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                        f"{exc.start + 1}): convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8")
            if fmt != "jsonl" or not line.strip():
                continue
            start = line.strip()[:60] + ("..." if len(line.strip()) > 60 else "")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                return (f"{path.name} line {number} is not JSON ({exc.msg} at column {exc.colno}): {start!r}; "
                        "each line must be one JSON object")
            if not isinstance(obj, dict):
                return f"{path.name} line {number} is not a JSON object: {start!r}; each line must be one JSON object"
    return None


@dataclass(frozen=True)
class InputColumns:
    """Which input columns feed the job. Exactly one of prompt / messages is set."""

    prompt: str | None = None
    messages: str | None = None
    id: str | None = None
    max_new_tokens: str | None = None  # per-row token budget, overriding --max-new-tokens
    json_schema: str | None = None  # per-row JSON schema (its text), overriding --json-schema

    @property
    def needed(self) -> list[str]:
        names = [self.prompt, self.messages, self.id, self.max_new_tokens, self.json_schema]
        return list(dict.fromkeys(n for n in names if n is not None))


class InputFile:
    """An opened, validated input of rows (Parquet, JSONL or CSV). Nothing is read beyond the schema (a
    Parquet footer, a text file's first block) until `batches()`."""

    def __init__(self, path: Path, columns: InputColumns, fmt: str = "auto") -> None:
        self.path = Path(path).expanduser().resolve()
        self.columns = columns
        if not self.path.exists():
            raise InputError(f"input file {path} does not exist")
        if self.path.is_dir():
            raise InputError(f"input {path} is a directory: give a .parquet, .jsonl or .csv file")
        self.format = detect_format(self.path, fmt)
        if self.format == "openai":
            raise InputError(f"{path} is an OpenAI batch file: submit reads it as one (its lines' bodies are the "
                             "requests), without column flags")
        self._file = RowFile(self.path, self.format,
                             text_columns=[c for c in (columns.prompt, columns.id, columns.json_schema) if c],
                             int_columns=[columns.max_new_tokens] if columns.max_new_tokens else [])
        self.schema = self._file.schema
        self.num_rows = self._file.num_rows  # None until read, for JSONL and CSV
        check_columns(self.schema, columns, self.path.name)
        if self.num_rows == 0:
            raise InputError(f"{path} has no rows: nothing to submit")

    @property
    def column_names(self) -> list[str]:
        return list(self.schema.names)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.path)

    def batches(self, batch_rows: int = BATCH_ROWS, all_columns: bool = False) -> Iterator[pa.RecordBatch]:
        """Only the needed columns (or all), a batch at a time: memory stays flat whatever the file size."""
        yield from self._file.batches(None if all_columns else self.columns.needed, batch_rows)

def check_columns(schema: pa.Schema, columns: InputColumns, name: str) -> None:
    """InputError where a column the flags name is missing from the input `name` or holds the wrong type."""
    available = list(schema.names)
    for flag, column in (("--prompt-column", columns.prompt), ("--messages-column", columns.messages),
                         ("--id-column", columns.id), ("--max-new-tokens-column", columns.max_new_tokens),
                         ("--json-schema-column", columns.json_schema)):
        if column is not None and column not in available:
            raise InputError(f"{name} has no column {column!r} ({flag}); its columns are: {', '.join(available)}")
    if columns.prompt is not None and not _is_text_type(kind := schema.field(columns.prompt).type):
        raise InputError(f"column {columns.prompt!r} holds {kind}, not text: --prompt-column needs a string column "
                         "(use --messages-column for chat messages)")
    if columns.messages is not None and not _is_messages_type(kind := schema.field(columns.messages).type):
        raise InputError(f"column {columns.messages!r} holds {kind}: --messages-column needs a list of "
                         "{role: string, content: string} structs")
    if columns.max_new_tokens is not None \
            and not pa.types.is_integer(kind := schema.field(columns.max_new_tokens).type):
        raise InputError(f"column {columns.max_new_tokens!r} holds {kind}: --max-new-tokens-column needs an integer "
                         "column")
    if columns.json_schema is not None and not _is_text_type(kind := schema.field(columns.json_schema).type):
        raise InputError(f"column {columns.json_schema!r} holds {kind}: --json-schema-column needs a string column "
                         "of JSON schemas")
    if columns.id is not None and pa.types.is_nested(kind := schema.field(columns.id).type):
        raise InputError(f"column {columns.id!r} holds {kind}: --id-column needs a scalar column (string or "
                         "integer)")


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

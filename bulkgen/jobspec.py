"""A job spec: what `submit` flags and a job file (`jobs/*.toml`) both describe.

A job file's keys are the flags' long names (`max_new_tokens` or `max-new-tokens`); flags given on
the command line override the file. `input` is read relative to the job file.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from bulkgen.config import SamplingParams, parse_json_schema
from bulkgen.errors import ConfigError
from bulkgen.hub import with_gguf_file
from bulkgen.io import openai_batch
from bulkgen.io.rows import INPUT_FORMATS, InputColumns, detect_format
from bulkgen.resolve import default_model

SAMPLING_KEYS = {f.name for f in fields(SamplingParams)}
DEFAULT_SEED = 0

# What each job-file key must hold, as TOML gives it (a job file is checked as strictly as the flags are).
_TEXT, _FLAG, _WHOLE, _NUMBER = "a string", "true or false", "an integer", "a number"
_TEXTS, _WHOLES = "a string or a list of strings", "an integer or a list of integers"
FILE_KEY_TYPES = {
    "input": _TEXT, "model": _TEXT, "gguf_file": _TEXT, "name": _TEXT, "prompt_column": _TEXT, "messages_column": _TEXT,
    "id_column": _TEXT, "max_new_tokens_column": _TEXT, "system_prompt": _TEXT, "chat": _FLAG, "n": _WHOLE,
    "add_special_tokens": _FLAG, "max_new_tokens": _WHOLE, "temperature": _NUMBER, "top_p": _NUMBER,
    "top_k": _WHOLE, "min_p": _NUMBER, "repetition_penalty": _NUMBER,
    "frequency_penalty": _NUMBER, "presence_penalty": _NUMBER, "stop": _TEXTS, "stop_token_ids": _WHOLES,
    "ignore_eos": _FLAG, "seed": _WHOLE, "logprobs": _WHOLE, "input_format": _TEXT,
    "json_schema_column": _TEXT,
}


def _is(value: Any, kind: str) -> bool:
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == _TEXT:
        return isinstance(value, str)
    if kind == _FLAG:
        return isinstance(value, bool)
    if kind == _WHOLE:
        return whole
    if kind == _NUMBER:
        return whole or isinstance(value, float)
    if kind == _TEXTS:
        return isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)
    return whole or isinstance(value, list) and all(_is(v, _WHOLE) for v in value)


@dataclass(frozen=True)
class JobSpec:
    input: Path
    model: str = field(default_factory=default_model)
    name: str | None = None
    prompt_column: str | None = None  # default "prompt" unless messages_column is set
    messages_column: str | None = None
    id_column: str | None = None
    max_new_tokens_column: str | None = None
    system_prompt: str | None = None
    chat: bool = False  # wrap a raw prompt as a user message and apply the chat template
    n: int = 1  # samples per row
    add_special_tokens: bool | None = None  # None: yes for raw text, no for chat-rendered text
    input_format: str = "auto"  # parquet, jsonl, csv, openai; auto: from the file's name and first bytes
    json_schema_column: str | None = None  # per-row JSON schemas
    # an OpenAI batch file's job without --model runs the model its first line names, and a line naming another
    # fails alone; with --model every line runs on it whatever its "model" says (kept for the export's body)
    model_from_file: bool = False
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(seed=DEFAULT_SEED))

    def __post_init__(self) -> None:
        if self.prompt_column is not None and self.messages_column is not None:
            raise ConfigError("give either --prompt-column or --messages-column, not both")
        if self.prompt_column is None and self.messages_column is None:
            object.__setattr__(self, "prompt_column", "prompt")
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n (samples per row) must be an integer >= 1, got {self.n!r}")
        if self.n > 1 and self.sampling.is_greedy:
            raise ConfigError(f"n={self.n} with temperature 0 would give {self.n} identical greedy samples: "
                              "set --temperature above 0, or use --n 1")
        if self.system_prompt is not None and self.messages_column is None and not self.chat:
            raise ConfigError("--system-prompt needs chat rendering: add --chat (raw prompt as a user message) "
                              "or use --messages-column")
        if self.input_format not in INPUT_FORMATS:
            raise ConfigError(f"input format must be one of {', '.join(INPUT_FORMATS)}, got {self.input_format!r}")
        if self.sampling.seed is None:
            object.__setattr__(self, "sampling", self.sampling.replace(seed=DEFAULT_SEED))

    @property
    def uses_chat_template(self) -> bool:
        return self.chat or self.messages_column is not None

    @property
    def columns(self) -> InputColumns:
        return InputColumns(prompt=self.prompt_column, messages=self.messages_column, id=self.id_column,
                            max_new_tokens=self.max_new_tokens_column, json_schema=self.json_schema_column)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["input"] = str(self.input)
        out["sampling"] = self.sampling.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        data = dict(data)
        data["input"] = Path(data["input"])
        data["sampling"] = SamplingParams.from_dict(data.get("sampling") or {})
        return cls(**data)


def build_spec(input_path: Path, options: dict[str, Any]) -> JobSpec:
    """A spec from the submit argument (a Parquet file or a job file) and the flags the user gave.

    `options` holds only the flags given on the command line (None for the others)."""
    values: dict[str, Any] = {}
    if input_path.suffix == ".toml":
        values.update(read_job_file(input_path))
    else:
        values["input"] = input_path
    values.update({k: v for k, v in options.items() if v is not None and v != ()})
    if values.get("gguf_file"):  # one string names the model: ORG/NAME:FILE.gguf
        values["model"] = with_gguf_file(values.get("model") or default_model(), values.pop("gguf_file"))
    values.pop("gguf_file", None)
    if "input" not in values:
        raise ConfigError(f"job file {input_path} does not name its input: add input = \"data.parquet\"")
    sampling = {k: values.pop(k) for k in list(values) if k in SAMPLING_KEYS}
    if sampling.get("json_schema") is not None:
        sampling["json_schema"] = load_schema(sampling["json_schema"])
    _openai_defaults(values, sampling)
    known = {f.name for f in fields(JobSpec)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown job setting(s) {unknown}; known: {sorted(known - {'sampling'} | SAMPLING_KEYS)}")
    try:
        return JobSpec(**values, sampling=SamplingParams.from_dict(sampling))
    except TypeError as exc:
        raise ConfigError(f"invalid job setting: {exc}") from exc


def load_schema(value: Any) -> str:
    """--json-schema: a file's path or the schema's JSON text (a job file may give a table) -> compact JSON."""
    if isinstance(value, dict):
        schema = value
    else:
        text = str(value).strip()
        if not text.startswith("{"):
            path = Path(text).expanduser()
            if not path.is_file():
                raise ConfigError(f"--json-schema {text!r} is neither a JSON object nor a file")
            text = path.read_text()
        schema = parse_json_schema(text, "--json-schema")
    return json.dumps(schema, separators=(",", ":"), sort_keys=True)


def _openai_defaults(values: dict[str, Any], sampling: dict[str, Any]) -> None:
    """An OpenAI batch file's job runs every line on --model whatever the line's "model" says; without --model,
    on the model its first line names. As OpenAI does, it samples at temperature 1 where neither a line nor
    --temperature says otherwise."""
    path = Path(values["input"]).expanduser()
    if not path.is_file() or values.get("input_format", "auto") not in ("auto", "openai"):
        return

    if detect_format(path, values.get("input_format", "auto")) != "openai":
        return
    if "model" not in values:
        named = openai_batch.first_model(path)
        if named is None:
            raise ConfigError(f"{path.name}: its first line names no model; give --model (every line then runs on it)")
        values["model"] = named
        values["model_from_file"] = True
    sampling.setdefault("temperature", 1.0)


def read_job_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"job file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read job file {path}: {exc}") from exc
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and key == "sampling":
            values.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            values[key.replace("-", "_")] = value
    for key, value in values.items():
        kind = FILE_KEY_TYPES.get(key)
        if kind is not None and not _is(value, kind):
            shown = json.dumps(value, default=str)  # as TOML writes it: true, "yes", ["a"]
            raise ConfigError(f"job file {path}: {key} = {shown} must be {kind}")
    if "input" in values:
        values["input"] = (path.parent / values["input"]).resolve()
    for key in ("stop", "stop_token_ids"):
        if key in values and not isinstance(values[key], list):
            values[key] = [values[key]]
    return values

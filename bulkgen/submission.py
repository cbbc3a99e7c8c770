"""Submit: a file of rows (Parquet, JSONL, CSV) or an OpenAI batch file becomes a job of requests, each
rendered, tokenized once and seeded.

Everything that can be checked before writing (the file, its columns, the flags, the model) is checked
first, so a refused submit leaves no job behind. A bad row becomes a failed request with its reason.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from bulkgen.config import Paths
from bulkgen.errors import ConfigError, InputError
from bulkgen.io import openai_batch
from bulkgen.io.rows import InputFile, detect_format
from bulkgen.jobspec import JobSpec
from bulkgen.resolve import load_tokenizer, model_limits, past_window, resolve_model
from bulkgen.store import Store
from bulkgen.store import jobs as job_ops
from bulkgen.store.models import RequestState, pack_ids, utcnow

ROWS_PER_TRANSACTION = 16_384


@dataclass(frozen=True)
class SubmitReport:
    job_id: int
    num_rows: int
    num_requests: int
    num_failed: int  # requests refused at submit (bad rows), with their reasons stored
    num_prompt_tokens: int
    seconds: float
    model_path: str

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "num_rows": self.num_rows, "num_requests": self.num_requests,
                "num_failed": self.num_failed, "num_prompt_tokens": self.num_prompt_tokens,
                "seconds": round(self.seconds, 3), "model_path": self.model_path}


def request_seed(job_seed: int, row: int, sample: int) -> int:
    """Each request's own seed: its sampled output never depends on what it was batched with."""
    digest = hashlib.blake2b(f"{job_seed}:{row}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits a signed 64-bit column


def submit_job(store: Store, spec: JobSpec, paths: Paths | None = None,
               log: Callable[[str], None] | None = None,
               on_rows: Callable[[int], None] | None = None) -> SubmitReport:
    start = time.perf_counter()
    path = spec.input.expanduser().resolve()
    if path.is_file() and detect_format(path, spec.input_format) == "openai":
        return submit_openai(store, replace(spec, input=path, input_format="openai"), paths, log, on_rows)
    source = InputFile(spec.input, spec.columns, spec.input_format)
    spec = replace(spec, input_format=source.format)
    model = resolve_model(spec.model, paths, log)
    renderer = PromptRenderer(spec, model.path)

    with store.session_scope(write=True) as session:
        job_id = job_ops.create_job(
            session, name=spec.name, model=spec.model, model_path=str(model.path), input_path=str(source.path),
            input_fingerprint=source.fingerprint, input_columns=source.column_names, spec=spec.to_dict(),
        ).id
    num_rows = num_requests = num_failed = num_prompt_tokens = 0
    first_error: tuple[int, str] | None = None
    try:
        pending: list[dict[str, Any]] = []
        for batch in source.batches():
            rows = renderer.requests(job_id, batch, first_row=num_rows)
            num_rows += batch.num_rows
            num_requests += len(rows)
            failed = [r for r in rows if r["state"] == RequestState.FAILED.value]
            num_failed += len(failed)
            if failed and first_error is None:
                first_error = failed[0]["row"], failed[0]["error"]
            num_prompt_tokens += sum(r["num_prompt_tokens"] for r in rows)
            pending.extend(rows)
            if len(pending) >= ROWS_PER_TRANSACTION:
                with store.session_scope(write=True) as session:
                    job_ops.insert_requests(session, pending)
                pending = []
            if on_rows:
                on_rows(batch.num_rows)
        if num_rows == 0:
            raise InputError(f"{source.path} has no rows: nothing to submit")
        if num_requests and num_failed == num_requests:
            row, error = first_error
            raise InputError(f"no row of {source.path} can run: all {num_rows} rows are bad (row {row}: {error}); "
                             "fix the input or the column flags (nothing was submitted)")
        with store.session_scope(write=True) as session:
            job_ops.insert_requests(session, pending)
            job_ops.open_job(session, job_id, num_requests)
    except BaseException:
        with store.session_scope(write=True) as session:
            job_ops.delete_job(session, job_id)
        raise
    return SubmitReport(job_id, num_rows, num_requests, num_failed, num_prompt_tokens,
                        time.perf_counter() - start, str(model.path))


def submit_openai(store: Store, spec: JobSpec, paths: Paths | None = None, log: Callable[[str], None] | None = None,
                  on_rows: Callable[[int], None] | None = None) -> SubmitReport:
    """An OpenAI batch file (io/openai_batch.py): each line a row of `n` requests with the line's own
    settings; a line that cannot run fails alone, a file that is not a batch file is refused whole."""
    start = time.perf_counter()
    model = resolve_model(spec.model, paths, log)
    renderer = PromptRenderer(spec, model.path)
    fingerprint = f"size={spec.input.stat().st_size};mtime_ns={spec.input.stat().st_mtime_ns}"
    with store.session_scope(write=True) as session:
        job_id = job_ops.create_job(
            session, name=spec.name, model=spec.model, model_path=str(model.path), input_path=str(spec.input),
            input_fingerprint=fingerprint, input_columns=["custom_id"], spec=spec.to_dict()).id
    counts = {"rows": 0, "requests": 0, "failed": 0, "prompt_tokens": 0}
    first_error: tuple[int, str] | None = None
    try:
        pending: list[dict[str, Any]] = []
        chunk: list[openai_batch.BatchLine] = []

        def flush() -> None:
            nonlocal first_error
            rows = renderer.openai_requests(job_id, chunk, first_row=counts["rows"])
            counts["rows"] += len(chunk)
            counts["requests"] += len(rows)
            failed = [r for r in rows if r["state"] == RequestState.FAILED.value]
            counts["failed"] += len(failed)
            if failed and first_error is None:
                first_error = failed[0]["row"], failed[0]["error"]
            counts["prompt_tokens"] += sum(r["num_prompt_tokens"] for r in rows)
            pending.extend(rows)
            if on_rows:
                on_rows(len(chunk))
            chunk.clear()

        for line in openai_batch.read_lines(spec.input):
            chunk.append(line)
            if len(chunk) >= openai_batch.LINES_PER_BATCH:
                flush()
                if len(pending) >= ROWS_PER_TRANSACTION:
                    with store.session_scope(write=True) as session:
                        job_ops.insert_requests(session, pending)
                    pending.clear()
        if chunk:
            flush()
        if counts["rows"] == 0:
            raise InputError(f"{spec.input.name} has no request lines: nothing to submit")
        if counts["failed"] == counts["requests"]:
            row, error = first_error
            raise InputError(f"no line of {spec.input.name} can run: all {counts['rows']} fail (line of row {row}: "
                             f"{error}); nothing was submitted")
        with store.session_scope(write=True) as session:
            job_ops.insert_requests(session, pending)
            job_ops.open_job(session, job_id, counts["requests"])
    except BaseException:
        with store.session_scope(write=True) as session:
            job_ops.delete_job(session, job_id)
        raise
    return SubmitReport(job_id, counts["rows"], counts["requests"], counts["failed"], counts["prompt_tokens"],
                        time.perf_counter() - start, str(model.path))


class PromptRenderer:
    """Turns input rows into request rows: text rendered, tokenized in one batched call, checked."""

    def __init__(self, spec: JobSpec, model_dir) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer(model_dir)
        self.context_length, self.sliding_window = model_limits(model_dir)
        sampling = spec.sampling
        if spec.uses_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"model {spec.model} has no chat template: use raw prompts (--prompt-column "
                              "without --chat)")
        if sampling.max_new_tokens >= self.context_length:
            raise ConfigError(f"max-new-tokens {sampling.max_new_tokens} leaves no room for a prompt in the "
                              f"model's context of {self.context_length} tokens: lower it")
        if self.sliding_window is not None and sampling.max_new_tokens >= self.sliding_window:
            raise ConfigError(f"max-new-tokens {sampling.max_new_tokens} leaves no room for a prompt: "
                              f"{past_window(sampling.max_new_tokens + 1, self.sliding_window)}")
        vocab = len(self.tokenizer)
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise ConfigError(f"stop token ids {bad} are outside the vocabulary (size {vocab})")
        self.add_special_tokens = (spec.add_special_tokens if spec.add_special_tokens is not None
                                   else not spec.uses_chat_template)
        self._grammars = None
        self._schema_errors: dict[str, str | None] = {}
        if sampling.json_schema is not None:
            error = self.schema_error(sampling.json_schema)
            if error:
                raise ConfigError(f"--json-schema: {error}")

    def schema_error(self, schema: str) -> str | None:
        """Why a JSON schema cannot constrain this model's output (the compiler's words), or None."""
        if schema not in self._schema_errors:
            from bulkgen.engine.grammar import Grammars

            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, len(self.tokenizer))
            try:
                self._grammars.check(schema)
                self._schema_errors[schema] = None
            except ConfigError as exc:
                self._schema_errors[schema] = str(exc)
        return self._schema_errors[schema]

    def requests(self, job_id: int, batch: pa.RecordBatch, first_row: int) -> list[dict[str, Any]]:
        spec = self.spec
        columns = {name: batch.column(name).to_pylist() for name in spec.columns.needed}
        texts: list[str | None] = []
        errors: list[str | None] = []
        for i in range(batch.num_rows):
            text, error = self._render(columns, i)
            texts.append(text)
            errors.append(error)
        valid = [i for i, t in enumerate(texts) if t is not None]
        # (a batch may hold no valid row at all: the tokenizer fails on an empty list)
        encoded = self.tokenizer([texts[i] for i in valid], add_special_tokens=self.add_special_tokens)["input_ids"] \
            if valid else []
        token_ids: list[list[int] | None] = [None] * batch.num_rows
        for i, ids in zip(valid, encoded, strict=True):
            token_ids[i] = ids
        ids_column = columns.get(spec.id_column) if spec.id_column else None
        budgets = columns.get(spec.max_new_tokens_column) if spec.max_new_tokens_column else None
        schemas = columns.get(spec.json_schema_column) if spec.json_schema_column else None
        now = utcnow()
        out = []
        for i in range(batch.num_rows):
            row = first_row + i
            ids = token_ids[i]
            max_new = spec.sampling.max_new_tokens if budgets is None or budgets[i] is None else budgets[i]
            error = errors[i] or self._check(ids, max_new)
            params = None
            if schemas is not None and schemas[i] is not None and error is None:
                params, error = self._row_schema(schemas[i])
            for sample in range(spec.n):
                out.append({
                    "job_id": job_id, "row": row, "sample": sample,
                    "custom_id": None if ids_column is None or ids_column[i] is None else str(ids_column[i]),
                    "prompt": texts[i],
                    "prompt_token_ids": pack_ids(ids) if error is None else None,
                    "num_prompt_tokens": len(ids) if ids is not None else 0,
                    "max_new_tokens": max(int(max_new), 1),
                    "seed": request_seed(spec.sampling.seed or 0, row, sample),
                    "state": RequestState.FAILED.value if error else RequestState.PENDING.value,
                    "attempts": 0, "error": error, "updated_at": now, "params": params,
                })
        return out

    def _row_schema(self, text: str) -> tuple[dict[str, Any] | None, str | None]:
        from bulkgen.jobspec import load_schema

        try:
            schema = load_schema(text) if text.strip().startswith("{") else None
        except ConfigError as exc:
            return None, f"json schema: {exc}"
        if schema is None:
            return None, "json schema: not a JSON object"
        error = self.schema_error(schema)
        return ({"sampling": {"json_schema": schema}}, None) if error is None else (None, f"json schema: {error}")

    def openai_requests(self, job_id: int, lines: list[openai_batch.BatchLine], first_row: int) -> list[dict[str, Any]]:
        """Request rows of OpenAI batch lines: n a line, the line's settings kept in `params`."""
        spec = self.spec
        prepared: list[tuple[dict[str, Any], int, str, str | None, bool]] = []  # own, n, url, text, special
        errors: list[str | None] = []
        for line in lines:
            try:
                if line.error:
                    raise ValueError(line.error)
                own, n, url = openai_batch.line_settings(line, spec.sampling, spec.model)
                text, special = openai_batch.render(line, self._chat_template)
                prepared.append((own, n, url, text, special))
                errors.append(None)
            except ValueError as exc:
                prepared.append(({}, 1, line.url, None, False))
                errors.append(str(exc))
        token_ids: list[list[int] | None] = [None] * len(lines)
        for special in (True, False):
            which = [i for i, p in enumerate(prepared) if p[3] is not None and p[4] is special]
            if which:
                encoded = self.tokenizer([prepared[i][3] for i in which], add_special_tokens=special)["input_ids"]
                for i, ids in zip(which, encoded, strict=True):
                    token_ids[i] = ids
        now = utcnow()
        out = []
        for i, line in enumerate(lines):
            own, n, url, text, _ = prepared[i]
            own = dict(own)
            ids = token_ids[i]
            max_new = own.pop("max_new_tokens", spec.sampling.max_new_tokens)
            line_seed = own.pop("seed", None)
            error = errors[i] or self._check(ids, max_new)
            if error is None and own.get("json_schema") is not None:
                error = self.schema_error(own["json_schema"])
            row = first_row + i
            for sample in range(n):
                out.append({
                    "job_id": job_id, "row": row, "sample": sample, "custom_id": line.custom_id, "prompt": text,
                    "prompt_token_ids": pack_ids(ids) if error is None else None,
                    "num_prompt_tokens": len(ids) if ids is not None else 0, "max_new_tokens": max_new,
                    # a line's own seed gives the same samples wherever the line sits in the file
                    "seed": request_seed(line_seed, 0, sample) if line_seed is not None
                    else request_seed(spec.sampling.seed or 0, row, sample),
                    "state": RequestState.FAILED.value if error else RequestState.PENDING.value,
                    "attempts": 0, "error": error, "updated_at": now,
                    "params": {"sampling": own, "openai": {"url": url, "model": spec.model}},
                })
        return out

    def _chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.spec.model} has no chat template: send {openai_batch.COMPLETIONS_URL} "
                             "requests instead")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may raise anything on messages it rejects
            raise ValueError(f"chat template failed: {exc}") from exc

    def _render(self, columns: dict[str, list[Any]], i: int) -> tuple[str | None, str | None]:
        spec = self.spec
        if spec.messages_column is not None:
            messages = columns[spec.messages_column][i]
            if not messages:
                return None, "messages are null or empty"
            if any(not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]
                   or not isinstance(m.get("content"), (str, list)) for m in messages):
                return None, "every message needs a role (a string) and a content (a string or a list of parts)"
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            prompt = columns[spec.prompt_column][i]
            if prompt is None:
                return None, "prompt is null"
            if not prompt.strip():
                return None, "prompt is empty"
            if not spec.chat:
                return prompt, None
            messages = [{"role": "user", "content": prompt}]
        if spec.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": spec.system_prompt}, *messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may raise anything on messages it rejects
            return None, f"chat template failed: {exc}"
        return text, None

    def _check(self, ids: list[int] | None, max_new_tokens: int) -> str | None:
        if ids is None:
            return None
        if not ids:
            return "prompt has no tokens"
        if max_new_tokens < 1:
            return f"max_new_tokens is {max_new_tokens}: it must be >= 1"
        if len(ids) + max_new_tokens > self.context_length:
            return (f"prompt has {len(ids)} tokens: with max_new_tokens {max_new_tokens} it exceeds the model's "
                    f"context of {self.context_length} tokens; shorten the prompt or lower max_new_tokens")
        too_long = past_window(len(ids) + max_new_tokens, self.sliding_window)
        if too_long:
            return f"prompt has {len(ids)} tokens with max_new_tokens {max_new_tokens}: {too_long}"
        return None

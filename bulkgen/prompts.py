"""Prompts rendered and checked: input rows (a table's batch, or an OpenAI batch file's lines) become
request rows (store/jobs.request_row), each rendered once (raw text, or chat messages through the
model's chat template), tokenized in one batched call, checked against the model's limits and seeded.

A row that cannot run becomes a failed request with its reason; a setting that no row can run with is
refused (ConfigError) before anything is written. Submit (submission.py) and the in-memory stage
(api.Generate) both render here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from bulkgen.config import request_seed
from bulkgen.errors import ConfigError
from bulkgen.io import openai_batch
from bulkgen.jobspec import JobSpec, load_schema
from bulkgen.model import chat_prompt, limits, load_tokenizer
from bulkgen.schema import Schemas
from bulkgen.store.jobs import request_row
from bulkgen.store.models import utcnow

Messages = list[dict[str, Any]]


class PromptRenderer:
    """Turns input rows into request rows for one job spec and one model."""

    def __init__(self, spec: JobSpec, model_dir: Path) -> None:
        self.spec = spec
        self.tokenizer = load_tokenizer(model_dir)
        self.context_length = limits(model_dir)
        sampling = spec.sampling
        if spec.uses_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"model {spec.model} has no chat template: use raw prompts (--prompt-column "
                              "without --chat)")
        if sampling.max_new_tokens >= self.context_length:
            raise ConfigError(f"max-new-tokens {sampling.max_new_tokens} leaves no room for a prompt in the "
                              f"model's context of {self.context_length} tokens: lower it")
        vocab = len(self.tokenizer)
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise ConfigError(f"stop token ids {bad} are outside the vocabulary (size {vocab})")
        self.add_special_tokens = (spec.add_special_tokens if spec.add_special_tokens is not None
                                   else not spec.uses_chat_template)
        self._schemas: Schemas | None = None
        if sampling.json_schema is not None:
            error = self.schema_error(sampling.json_schema)
            if error:
                raise ConfigError(f"--json-schema: {error}")

    def schema_error(self, schema: str) -> str | None:
        """Why a JSON schema cannot constrain this model's output (the compiler's words), or None."""
        if self._schemas is None:
            self._schemas = Schemas(self.tokenizer, len(self.tokenizer))
        return self._schemas.error(schema)

    # ------------------------------------------------------------------ a table's rows

    def table_rows(self, job_id: int, batch: pa.RecordBatch, first_row: int) -> list[dict[str, Any]]:
        """Request rows of a batch of input rows, spec.n a row; the columns are read as spec.columns (the
        InputColumns that io/rows.check_columns checked) names them."""
        spec, names = self.spec, self.spec.columns
        columns = {name: batch.column(name).to_pylist() for name in names.needed}
        rendered = [self._render(columns, i) for i in range(batch.num_rows)]
        token_ids = self._tokenize([text for text, _ in rendered], self.add_special_tokens)
        custom_ids, budgets, schemas = (columns.get(name) if name else None
                                        for name in (names.id, names.max_new_tokens, names.json_schema))
        now = utcnow()
        out = []
        for i, (text, error) in enumerate(rendered):
            row, ids = first_row + i, token_ids[i]
            max_new = spec.sampling.max_new_tokens if budgets is None or budgets[i] is None else budgets[i]
            error = error or self._check(ids, max_new)
            params = None
            if schemas is not None and schemas[i] is not None and error is None:
                params, error = self._row_schema(schemas[i])
            custom_id = None if custom_ids is None or custom_ids[i] is None else str(custom_ids[i])
            out.extend(request_row(job_id, row, sample, ids, max_new, request_seed(spec.sampling.seed, row, sample),
                                   error=error, custom_id=custom_id, prompt=text, params=params, now=now)
                       for sample in range(spec.n))
        return out

    def _row_schema(self, text: str) -> tuple[dict[str, Any] | None, str | None]:
        try:
            schema = load_schema(text) if text.strip().startswith("{") else None
        except ConfigError as exc:
            return None, f"json schema: {exc}"
        if schema is None:
            return None, "json schema: not a JSON object"
        error = self.schema_error(schema)
        return ({"sampling": {"json_schema": schema}}, None) if error is None else (None, f"json schema: {error}")

    def _render(self, columns: dict[str, list[Any]], i: int) -> tuple[str | None, str | None]:
        """A row's prompt text, or None and why."""
        spec, names = self.spec, self.spec.columns
        if names.messages is not None:
            messages = columns[names.messages][i]
            if not messages:
                return None, "messages are null or empty"
            if any(not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]
                   or not isinstance(m.get("content"), (str, list)) for m in messages):
                return None, "every message needs a role (a string) and a content (a string or a list of parts)"
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            prompt = columns[names.prompt][i]
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
            return self.chat_template(messages), None
        except ValueError as exc:
            return None, str(exc)

    # ------------------------------------------------------------------ an OpenAI batch file's lines

    def batch_rows(self, job_id: int, lines: list[openai_batch.BatchLine], first_row: int) -> list[dict[str, Any]]:
        """Request rows of OpenAI batch lines: a line's n of them, the line's own settings kept in `params`."""
        spec = self.spec
        settings: list[tuple[dict[str, Any], int, str]] = []  # the line's own sampling, n, url
        texts: list[str | None] = []
        specials: list[bool] = []
        errors: list[str | None] = []
        for line in lines:
            try:
                if line.error:
                    raise ValueError(line.error)
                settings.append(openai_batch.line_settings(
                    line, spec.sampling, spec.model if spec.model_from_file else None))
                text, special = openai_batch.render(line, self._line_template)
                texts.append(text)
                specials.append(special)
                errors.append(None)
            except ValueError as exc:
                settings.append(({}, 1, line.url))
                texts.append(None)
                specials.append(False)
                errors.append(str(exc))
        token_ids: list[list[int] | None] = [None] * len(lines)
        for special in (True, False):
            encoded = self._tokenize([t if s is special else None for t, s in zip(texts, specials, strict=True)],
                                     special)
            token_ids = [ids if ids is not None else kept for ids, kept in zip(encoded, token_ids, strict=True)]
        now = utcnow()
        out = []
        for i, line in enumerate(lines):
            own, n, url = settings[i]
            own = dict(own)
            ids, row = token_ids[i], first_row + i
            max_new = own.pop("max_new_tokens", spec.sampling.max_new_tokens)
            line_seed = own.pop("seed", None)
            error = errors[i] or self._check(ids, max_new)
            if error is None and own.get("json_schema") is not None:
                error = self.schema_error(own["json_schema"])
            named = line.body.get("model")  # what the export's body says: the line's own name, as OpenAI's clients read
            params = {"sampling": own, "openai": {"url": url,
                                                  "model": named if isinstance(named, str) and named else spec.model}}
            for sample in range(n):
                # a line's own seed gives the same samples wherever the line sits in the file
                seed = request_seed(line_seed, 0, sample) if line_seed is not None \
                    else request_seed(spec.sampling.seed, row, sample)
                out.append(request_row(job_id, row, sample, ids, max_new, seed, error=error, custom_id=line.custom_id,
                                       prompt=texts[i], params=params, now=now))
        return out

    def _line_template(self, messages: Messages) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.spec.model} has no chat template: send {openai_batch.COMPLETIONS_URL} "
                             "requests instead")
        return self.chat_template(messages)

    # ------------------------------------------------------------------ shared

    def chat_template(self, messages: Messages) -> str:
        return chat_prompt(self.tokenizer, messages)

    def _tokenize(self, texts: list[str | None], add_special_tokens: bool) -> list[list[int] | None]:
        """Token ids of each text in one batched call (None stays None)."""
        which = [i for i, text in enumerate(texts) if text is not None]
        out: list[list[int] | None] = [None] * len(texts)
        if which:  # (the tokenizer fails on an empty list)
            encoded = self.tokenizer([texts[i] for i in which], add_special_tokens=add_special_tokens)["input_ids"]
            for i, ids in zip(which, encoded, strict=True):
                out[i] = ids
        return out

    def _check(self, ids: list[int] | None, max_new_tokens: int) -> str | None:
        """Why a rendered prompt cannot run with this token budget, or None."""
        if ids is None:
            return None
        if not ids:
            return "prompt has no tokens"
        if max_new_tokens < 1:
            return f"max_new_tokens is {max_new_tokens}: it must be >= 1"
        if len(ids) + max_new_tokens > self.context_length:
            return (f"prompt has {len(ids)} tokens: with max_new_tokens {max_new_tokens} it exceeds the model's "
                    f"context of {self.context_length} tokens; shorten the prompt or lower max_new_tokens")
        return None


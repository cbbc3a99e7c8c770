"""OpenAI batch files in and out: the same .jsonl that goes to OpenAI's Batch API or `vllm run-batch`.

In: one request a line, {"custom_id", "method", "url", "body"}, streamed (memory flat for millions of
lines). A line that is not a JSON object with those four keys, or a custom_id seen before, refuses the
whole file (nothing is written); a line asking for what bulkgen cannot do (another url, another model, a
value out of range, a prompt too long for the context) becomes a failed request with its reason. Each line
becomes `n` requests (samples) of one row, with the line's own sampling settings kept beside them
(models.Request.params).

Out: one line per input line, in input order, `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`, the body a `chat.completion` or `text_completion` object with its n choices and usage;
a failed line has `"response": null` and `"error": {"code", "message"}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bulkgen.config import SamplingParams, request_sampling
from bulkgen.engine.protocol import FinishReason
from bulkgen.errors import InputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
REQUIRED = ("custom_id", "method", "url", "body")
LINES_PER_BATCH = 1024
# ours -> OpenAI's
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length"}
# body keys read; others (user, metadata, store, ...) change nothing here and are ignored, as OpenAI ignores
# what does not apply to a batch
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options",
                     "prediction", "reasoning_effort", "modalities", "audio", "web_search_options", "suffix",
                     "echo", "best_of", "logit_bias"})


class BatchLine:
    """One line read: its number (from 1), custom_id, url, body; `error` where it cannot run."""

    __slots__ = ("number", "custom_id", "url", "body", "error")

    def __init__(self, number: int, custom_id: str, url: str, body: dict[str, Any], error: str | None) -> None:
        self.number, self.custom_id, self.url, self.body, self.error = number, custom_id, url, body, error


def read_lines(path: Path) -> Iterator[BatchLine]:
    """Every request line of the file, checked for what refuses the whole file (InputError)."""
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path.name} line {number} is not JSON ({exc.msg}): an OpenAI batch file holds one "
                                 "JSON object a line") from exc
            if not isinstance(obj, dict):
                raise InputError(f"{path.name} line {number} is not a JSON object: an OpenAI batch file holds one "
                                 "request object a line")
            missing = [key for key in REQUIRED if key not in obj]
            if missing:
                raise InputError(f"{path.name} line {number} has no {', '.join(missing)}: every line needs "
                                 "custom_id, method, url and body")
            custom_id = obj["custom_id"]
            if not isinstance(custom_id, str) or not custom_id:
                raise InputError(f"{path.name} line {number}: custom_id must be a non-empty string")
            if custom_id in seen:
                raise InputError(f"{path.name} line {number} repeats custom_id {custom_id!r} (first on line "
                                 f"{seen[custom_id]}): each request needs its own")
            seen[custom_id] = number
            body = obj["body"]
            if not isinstance(body, dict):
                raise InputError(f"{path.name} line {number}: body must be a JSON object")
            error = None
            if obj["method"] != "POST":
                error = f"method {obj['method']!r} is not supported: only POST"
            elif obj["url"] not in URLS:
                error = f"url {obj['url']!r} is not supported: bulkgen runs {CHAT_URL} and {COMPLETIONS_URL}"
            yield BatchLine(number, custom_id, obj["url"], body, error)


def first_model(path: Path) -> str | None:
    """The model the first request line names (the job's model when --model is not given)."""
    for line in read_lines(path):
        model = line.body.get("model")
        return model if isinstance(model, str) and model else None
    return None


def line_settings(line: BatchLine, job_sampling: SamplingParams, job_model: str | None
                  ) -> tuple[dict[str, Any], int, str]:
    """A line's own sampling settings (over the job's), its n and its prompt source; ValueError with the
    reason where the line cannot run. `job_model`: the model a line must name (the job's model came from the
    file's first line); None when --model runs every line whatever it names."""
    body = line.body
    unknown = sorted(set(body) - IGNORED - {"model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                                            "temperature", "top_p", "n", "stop", "seed", "logprobs",
                                            "top_logprobs", "frequency_penalty", "presence_penalty",
                                            "response_format", "stream", "tools", "tool_choice", "functions",
                                            "function_call"})
    if unknown:
        raise ValueError(f"body field(s) {', '.join(unknown)} are not supported")
    if job_model is not None and body.get("model") not in (None, job_model):
        raise ValueError(f"model {body.get('model')!r} is not this job's model {job_model!r} (the first line's): "
                         "give --model at submit to run every line on one model, or submit these lines as their "
                         "own job")
    if body.get("stream"):
        raise ValueError("stream is not supported in a batch")
    if body.get("tools") or body.get("functions"):
        raise ValueError("tools and functions are not supported")
    own: dict[str, Any] = {}
    schema = response_schema(body.get("response_format"))
    if schema is not None:
        own["json_schema"] = schema
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    if budget is not None:
        own["max_new_tokens"] = _whole(budget, "max_tokens", 1)
    for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("frequency_penalty", "frequency_penalty"),
                      ("presence_penalty", "presence_penalty")):
        if key in body and body[key] is not None:
            if isinstance(body[key], bool) or not isinstance(body[key], (int, float)):
                raise ValueError(f"{key} must be a number, got {json.dumps(body[key])}")
            own[name] = float(body[key])
    if "temperature" in own and own["temperature"] > 2:
        raise ValueError(f"temperature must be in [0, 2], got {own['temperature']}")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise ValueError("stop must be a string or a list of up to 4 non-empty strings")
        own["stop"] = stops
    if body.get("seed") is not None:
        own["seed"] = _whole(body["seed"], "seed", 0) % (1 << 63)
    logprobs = _logprobs(body, line.url)
    if logprobs is not None:
        own["logprobs"] = logprobs
    n = _whole(body.get("n", 1), "n", 1)
    if n > 128:
        raise ValueError(f"n must be at most 128, got {n}")
    try:
        request_sampling(job_sampling, own)
    except Exception as exc:  # the sampling checks' own words
        raise ValueError(str(exc)) from exc
    return own, n, line.url


def response_schema(response_format: Any) -> str | None:
    """The JSON schema (its text) a response_format asks for: json_schema's, any object for json_object, None
    for text."""
    if response_format is None or response_format == {"type": "text"}:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON object")
        return json.dumps(schema, separators=(",", ":"), sort_keys=True)
    raise ValueError(f"response_format {json.dumps(response_format)} is not supported: text, json_object or "
                     "json_schema")


def _logprobs(body: dict[str, Any], url: str) -> int | None:
    if url == CHAT_URL:
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return _whole(body.get("top_logprobs") or 0, "top_logprobs", 0, 20)
    if body.get("logprobs") is None:
        return None
    return _whole(body["logprobs"], "logprobs", 0, 5)


def _whole(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {json.dumps(value)}")
    return value


def render(line: BatchLine, apply_chat_template: Callable[[list[dict[str, Any]]], str]) -> tuple[str, bool]:
    """The line's prompt text and whether the tokenizer adds its special tokens (raw completions text)."""
    body = line.body
    if line.url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        rendered = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError("every message needs a role (a string)")
            content = message.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ValueError("only text content parts are supported (no images or audio)")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ValueError("every message needs a content (a string or a list of text parts)")
            rendered.append({"role": message["role"], "content": content})
        return apply_chat_template(rendered), False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("prompt must be a string (one prompt a line)")
    if not prompt:
        raise ValueError("prompt is empty")
    return prompt, True


# ------------------------------------------------------------------------------------------------- out


def output_line(custom_id: str, job_id: int, row: int, params: dict[str, Any], samples: list[Any],
                created: int, decode: Callable[[list[int]], list[str]] | None) -> dict[str, Any]:
    """The output line of one input line from its requests (one per sample, in order): a response with
    every sample's choice where all completed, else an error."""
    request_id = f"req_{job_id}_{row}"
    line: dict[str, Any] = {"id": f"batch_req_{job_id}_{row}", "custom_id": custom_id}
    failed = [s for s in samples if s.state != "completed"]
    if failed:
        first = failed[0]
        code = {"failed": "invalid_request", "cancelled": "batch_cancelled"}.get(first.state, "batch_expired")
        message = first.error or {"cancelled": "the job was cancelled before this request ran",
                                  "pending": "not run yet", "running": "not finished yet"}.get(first.state, first.state)
        return {**line, "response": None, "error": {"code": code, "message": message}}
    origin = params.get("openai") or {}
    chat = origin.get("url", CHAT_URL) == CHAT_URL
    choices = []
    completion_tokens = 0
    for index, s in enumerate(samples):
        completion_tokens += s.num_output_tokens or 0
        finish = FINISH_REASONS.get(s.finish_reason, "stop")
        logprobs = _choice_logprobs(s.logprobs, chat, decode) if s.logprobs is not None and decode else None
        if chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": s.text, "refusal": None},
                            "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append({"index": index, "text": s.text, "logprobs": logprobs, "finish_reason": finish})
    prompt_tokens = samples[0].num_prompt_tokens or 0
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}-{row}",
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": origin.get("model") or "", "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": None}
    return {**line, "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def _choice_logprobs(entries: list[dict[str, Any]], chat: bool, decode: Callable[[list[int]], list[str]]
                     ) -> dict[str, Any]:
    ids = [e["token"] for e in entries] + [t for e in entries for t, _ in e.get("top", [])]
    texts = iter(decode(ids))
    chosen = [next(texts) for _ in entries]
    tops = [[(next(texts), lp) for _, lp in e.get("top", [])] for e in entries]
    if chat:
        return {"content": [{"token": token, "logprob": e["logprob"], "bytes": list(token.encode()),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]}
                            for token, e, top in zip(chosen, entries, tops, strict=True)], "refusal": None}
    return {"tokens": chosen, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(top) for top in tops], "text_offset": None}

"""What the worker (and a Ray actor, and `bulkgen.generate`) needs of an engine: requests in, finished
outputs out, a step at a time, and the typed objects handed across. `engine.Engine` is the one
implementation (and bench/queue_capacity.FixedEngine a model-free one); no torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from bulkgen.config import SamplingParams


class FinishReason(StrEnum):
    """Why a request's output ended, as results, exports and reports spell it (a str: stored as its value)."""

    STOP = "stop"  # a stop string or stop token
    EOS = "eos"  # the model's end of sequence
    LENGTH = "length"  # max_new_tokens, or the model's context
    ABORT = "abort"  # released unfinished (a drain, a cancel): no result is written
    ERROR = "error"  # failed (non-finite logits, a refused prompt)


@dataclass
class RequestOutput:
    request_id: Any
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str  # a FinishReason
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[Any] | None = None
    error: str | None = None
    time_to_first_token_s: float | None = None
    latency_s: float | None = None


@dataclass
class StepRecord:
    """One step, for the bench's plots and the worker's report."""

    time: float
    num_batched_tokens: int
    num_decode_tokens: int
    num_seqs: int
    kv_usage: float  # share of KV blocks held after scheduling
    num_preempted: int
    num_context_tokens: int = 0  # tokens the step's sequences attend to: the KV its attention reads


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0  # recomputation included
    num_output_tokens: int = 0
    num_draft_tokens: int = 0  # drafted tokens verified (engine/speculate.py)
    num_accepted_tokens: int = 0  # of them, kept
    num_running: int = 0  # sequences in the last step
    kv_usage: float = 0.0  # share of KV blocks held in the last step, after scheduling
    steps: list[StepRecord] = field(default_factory=list)
    keep_steps: bool = False


class EngineProtocol(Protocol):
    stats: EngineStats  # counters the caller reads between steps (output tokens, preemptions)

    @property
    def max_num_tokens(self) -> int:
        """Tokens the KV cache holds: what sizes how many requests are worth holding."""
        ...

    def describe(self) -> str:
        """One line for logs: model, dtype, device, kernel paths, KV cache."""
        ...

    def add(self, request_id: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; raises PromptTooLongError where it cannot fit the context."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one step; the requests that finished in it."""
        ...

    def abort(self, request_id: Any) -> RequestOutput | None:
        """Drop a request (None: the engine does not have it)."""
        ...

    def abort_waiting(self) -> list[RequestOutput]:
        """Drop every request that has not started."""
        ...

    def has_unfinished(self) -> bool: ...

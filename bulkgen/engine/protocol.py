"""What the worker (and, later, a Ray actor or `bulkgen.generate`) needs of an engine: requests in,
finished outputs out, a step at a time. `engine.Engine` is the one implementation; no torch here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from bulkgen.config import SamplingParams
    from bulkgen.engine.engine import EngineStats, RequestOutput


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

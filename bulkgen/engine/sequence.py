"""A sequence: one request inside the engine, with all of its per-request state. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from bulkgen.config import SamplingParams
from bulkgen.engine.protocol import FinishReason


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed, back in the waiting queue; recomputed when admitted again
    # Anything after PREEMPTED is finished.
    FINISHED_STOPPED = 3  # a stop string or stop token
    FINISHED_EOS = 4
    FINISHED_LENGTH = 5  # max_new_tokens, or the model's context
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # e.g. non-finite logits

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_EOS: FinishReason.EOS,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    SequenceStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False)
class Sequence:
    request_id: Any
    prompt_token_ids: list[int]
    params: SamplingParams
    # Prompt then output: the tokens whose K/V the sequence needs. Output ids are its tail.
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at first admission
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])  # one a group of layers (KVLayout)
    block_hashes: list[int] = field(default_factory=list)  # of the full, computed blocks
    prompt_hashes: list[int] | None = None  # of the prompt's full blocks, as the prefix cache keys them (once)
    # leading tokens whose blocks a running sequence that ends no sooner holds too: the packer's projection of KV
    # use counts them there, once (Scheduler._shared_tokens)
    num_shared_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    error: str | None = None
    # Tokens guessed to follow token_ids (speculate.py), not yet verified: the next step computes them beside the
    # sequence's own and keeps the longest prefix the model agrees with. Never part of token_ids before that.
    draft: list[int] = field(default_factory=list)
    draft_source: str = ""  # which drafter guessed them (speculate.DRAFTERS)
    ngrams: Any = None  # speculate.NgramIndex of token_ids, once the prompt drafter first looks
    # Filled by the engine (the sampler's generators, the detokenizer) and by the sampler.
    generators: list[Any] = field(default_factory=list)  # a sampled sequence's: one a row it samples in a step
    detokenizer: Any = None
    matcher: Any = None  # llguidance's, where the output must match a JSON schema (grammar.py)
    logprobs: list[Any] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def block_table(self) -> list[int]:
        """The first group's blocks (a model whose layers all attend alike has only that group)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, blocks: list[int]) -> None:
        self.block_tables = [blocks]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def draw_seed(self, position: int) -> int:
        """The seed of the draw that picks the token at `position` (a sampled request): its seed and the position
        mixed (splitmix64), so a draw depends on where it is, never on how many draws came before it; a draft's
        rows, kept or not, leave every later draw as it would have been."""
        return _mix(_mix(self.params.seed or 0) ^ position)

    def append_token(self, token_id: int, at: float | None = None) -> None:
        """A sampled token; `at`: when it was sampled (the clock the finish time is read from too)."""
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic() if at is None else at


def _mix(x: int) -> int:
    """splitmix64's finaliser, to 63 bits (torch's seeds)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1

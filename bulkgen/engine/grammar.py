"""JSON-schema constrained generation in the engine: each constrained sequence carries a matcher of its
schema (bulkgen/schema.py compiles them), and a step masks the logits of the constrained rows it samples.

A step asks `Constraints.begin` for its masks before the forward pass and applies them after it: on a
GPU llguidance fills them on its own threads while the forward pass runs; on a CPU after it (there the
forward's threads have every core, and a mask thread beside them slowed each step by more than the masks
cost: 19 % against 5 % at 8 rows on 2 cores). Each sampled token is then fed to its matcher (engine.py),
and a sequence whose grammar is complete stops. Unconstrained sequences pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from bulkgen.engine.scheduler import ScheduledSeq
from bulkgen.engine.sequence import Sequence
from bulkgen.schema import Schemas

_SHIFTS = torch.arange(32, dtype=torch.int32)
MaskKernel = Callable[[torch.Tensor, list[int], torch.Tensor], bool]


class Constraints:
    """The matchers of one engine's tokenizer (llguidance loaded when a first request asks for a schema),
    and each step's masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, overlap: bool, kernel: MaskKernel | None) -> None:
        self._tokenizer, self._vocab_size = hf_tokenizer, vocab_size
        self.overlap = overlap  # fill the masks while the forward pass runs
        self.kernel = kernel  # the C kernels' mask pass (cpu/ops.Ops.mask_tokens), where it applies
        self._schemas: Schemas | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None

    def matcher(self, schema: str) -> Any:
        if self._schemas is None:
            import llguidance.torch  # noqa: F401  (the bitmask helpers below)

            self._schemas = Schemas(self._tokenizer, self._vocab_size)
            self._executor = self._schemas.ll.LLExecutor()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="bulkgen-masks")
        return self._schemas.matcher(schema)

    def begin(self, scheduled: list[ScheduledSeq]) -> StepMasks:
        """The masks of the constrained sequences this step samples (those whose prompt is all computed): a row
        each, and one more for each token of a draft (the grammar's state after the draft's tokens before it)."""
        entries = [(s.seq, s.seq.draft[:s.num_draft_tokens]) for s in scheduled
                   if s.seq.matcher is not None and s.num_sampled]
        if not entries:
            return NO_MASKS  # an unconstrained step pays for the list above only
        masks = StepMasks(self, entries)
        if self.overlap:
            masks.start()
        return masks

    def start_fill(self, entries: list[tuple[Any, list[int]]]) -> Future:
        """The next-token bitmasks of these (matcher, draft) pairs, filled on llguidance's threads: a matcher's
        row, then one a draft token."""
        ll = self._schemas.ll
        rows = sum(1 + len(draft) for _, draft in entries)
        mask = ll.torch.allocate_token_bitmask(rows, self._schemas.tokenizer.vocab_size)
        return self._pool.submit(_fill, ll, self._executor, entries, mask)


class StepMasks:
    """One step's masks: started before the forward pass or after it, applied to its logits."""

    def __init__(self, constraints: Constraints | None, entries: list[tuple[Sequence, list[int]]]) -> None:
        self.constraints, self.entries = constraints, entries
        self.future: Future | None = None

    def start(self) -> None:
        self.future = self.constraints.start_fill([(seq.matcher, draft) for seq, draft in self.entries])

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, sampled: list[Sequence]) -> None:
        """-inf in place for what each constrained row's grammar refuses (logits [len(sampled), vocab]; a drafted
        sequence's rows follow one another there)."""
        if not self.entries:
            return
        if self.future is None:
            self.start()
        first: dict[int, int] = {}
        for i, seq in enumerate(sampled):
            first.setdefault(id(seq), i)
        rows = [first[id(seq)] + j for seq, draft in self.entries for j in range(1 + len(draft))]
        mask = self.future.result()
        kernel = self.constraints.kernel
        if kernel is None or not kernel(logits, rows, mask):
            mask_logits(logits, rows, mask)


NO_MASKS = StepMasks(None, [])  # a step with no constrained row: apply does nothing


def mask_logits(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """-inf in place for the tokens that bitmask rows ([len(rows), words] int32, bit j of word w allows
    token 32 w + j) refuse in these rows of logits [num_sampled, vocab]."""
    vocab = logits.shape[1]
    # the bitmask unpacked (llguidance's torch helper took 20x longer on a CPU here): by numpy on a CPU, in
    # a few tensor ops on the device elsewhere
    if logits.device.type == "cpu":
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits[:, :vocab].view(np.bool_))
    else:
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
        allowed = ((mask[:, :, None] >> _SHIFTS.to(mask.device)) & 1).view(len(rows), -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # ids past the tokenizer's: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    refused = ~allowed
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(refused, float("-inf"))
    else:  # row by row, in place (gathering and scattering the rows copied the logits twice)
        for i, row in enumerate(rows):
            logits[row].masked_fill_(refused[i], float("-inf"))


def _fill(llguidance: Any, executor: Any, entries: list[tuple[Any, list[int]]], mask: torch.Tensor) -> torch.Tensor:
    plain, drafted, row = [], [], 0
    for matcher, draft in entries:  # llguidance steps a drafted matcher through its draft and back
        (drafted if draft else plain).append((matcher, row, draft) if draft else (matcher, row))
        row += 1 + len(draft)
    if plain:
        llguidance.torch.fill_next_token_bitmask_par(executor, plain, mask)
    if drafted:
        llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, mask)
    return mask

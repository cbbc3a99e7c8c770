"""JSON-schema constrained generation through llguidance (a grammar engine made for this: Rust core, MIT).

Each constrained sequence carries a matcher compiled from its schema. A step computes the next-token masks
of every constrained sequence it will sample, all at once, on llguidance's own threads while the forward
pass runs; the masks are applied to those rows of the logits before sampling; each sampled token is then
fed to its matcher, and a sequence whose grammar is complete stops. Unconstrained sequences pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from bulkgen.config import parse_json_schema
from bulkgen.errors import ConfigError

_SHIFTS = torch.arange(32, dtype=torch.int32)


def require() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise ConfigError("JSON-schema outputs need llguidance (pip install llguidance)") from exc
    return llguidance


def grammar_text(schema: str) -> str:
    """llguidance's grammar for a JSON schema's text; ConfigError if it is not a JSON object."""
    llguidance = require()
    # compact JSON: free whitespace lets a weak model pad forever (and buys nothing in a dataset)
    return llguidance.LLMatcher.grammar_from_json_schema(parse_json_schema(schema),
                                                         defaults={"whitespace_flexible": False})


class Grammars:
    """Matchers for one tokenizer, and the step's masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        llguidance = require()
        self._ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="bulkgen-masks")
        self._compiled: dict[str, str] = {}

    def check(self, schema: str) -> None:
        """ConfigError with the compiler's words where the schema cannot be compiled."""
        grammar = self._grammar(schema)
        error = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ConfigError(f"the JSON schema cannot be compiled: {error}")

    def matcher(self, schema: str) -> Any:
        matcher = self._ll.LLMatcher(self.tokenizer, self._grammar(schema))
        if matcher.is_error():
            raise ConfigError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        return matcher

    def _grammar(self, schema: str) -> str:
        if schema not in self._compiled:
            self._compiled[schema] = grammar_text(schema)
        return self._compiled[schema]

    def start_masks(self, matchers: list[Any]) -> Future:
        """The next-token masks of these matchers ([len, words] int32), computed in the background."""
        mask = self._ll.torch.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        return self.pool.submit(_fill, self._ll, self.executor, matchers, mask)

    @torch.inference_mode()
    def apply(self, masks: Future, logits: torch.Tensor, rows: list[int],
              kernel: Callable[[torch.Tensor, list[int], torch.Tensor], bool] | None = None) -> None:
        """Mask the rows' disallowed tokens to -inf (logits [num_sampled, vocab], in place); `kernel`: the C
        kernels' (forward.Ops.mask_tokens), where it applies."""
        mask = masks.result()
        if kernel is None or not kernel(logits, rows, mask):
            mask_logits(logits, rows, mask)


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


def _fill(llguidance: Any, executor: Any, matchers: list[Any], mask: torch.Tensor) -> torch.Tensor:
    llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
    return mask

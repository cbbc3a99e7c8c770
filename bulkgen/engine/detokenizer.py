"""Incremental detokenization, so that stop strings are found as soon as they are generated.

Decoding only a short window of recent tokens per step keeps the cost constant per token; a token that
ends in the middle of a multi-byte character waits for the next one (the window then shows U+FFFD).
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 6  # prompt tokens decoded ahead of the output, so a first word keeps its leading space


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def push(self, token_id: int) -> int | None:
        """Add a token; return where a stop string starts in `text` if one is now complete."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        found = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def drop_incomplete_character(text: str) -> str:
    """An output cut by its token budget may end inside a multi-byte character, which decodes as U+FFFD:
    drop that incomplete character (the token ids keep every byte)."""
    return text.rstrip("\ufffd")

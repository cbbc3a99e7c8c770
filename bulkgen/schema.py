"""JSON schemas as grammars, through llguidance (a grammar engine made for this: Rust core, MIT): the
grammar of a schema, and the check that submit runs on every schema before anything is written. No
torch here; the engine's masks (engine/grammar.py) build on these.
"""

from __future__ import annotations

from typing import Any

from bulkgen.config import parse_json_schema
from bulkgen.errors import ConfigError


def require() -> Any:
    """The llguidance module, or a ConfigError that says how to install it."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:
        raise ConfigError("JSON-schema outputs need llguidance (pip install llguidance)") from exc
    return llguidance


def grammar_text(schema: str) -> str:
    """llguidance's grammar for a JSON schema's text; ConfigError if it is not a JSON object."""
    llguidance = require()
    # compact JSON: free whitespace lets a weak model pad forever (and buys nothing in a dataset)
    return llguidance.LLMatcher.grammar_from_json_schema(parse_json_schema(schema),
                                                         defaults={"whitespace_flexible": False})


class Schemas:
    """The schemas of one tokenizer: each compiled once, checked once."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.ll = require()
        try:
            self.tokenizer = self.ll.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        except ValueError as exc:  # llguidance: "vocab size too small", where the model has fewer logits
            raise ConfigError(f"JSON-schema outputs need a logit for every token of the tokenizer; the model has "
                              f"{vocab_size} and its tokenizer {len(hf_tokenizer)} ({exc})") from exc
        self._grammars: dict[str, str] = {}
        self._errors: dict[str, str | None] = {}

    def grammar(self, schema: str) -> str:
        if schema not in self._grammars:
            self._grammars[schema] = grammar_text(schema)
        return self._grammars[schema]

    def error(self, schema: str) -> str | None:
        """Why the schema cannot constrain this tokenizer's output (the compiler's words), or None."""
        if schema not in self._errors:
            try:
                problem = self.ll.LLMatcher.validate_grammar(self.grammar(schema), self.tokenizer)
                self._errors[schema] = f"the JSON schema cannot be compiled: {problem}" if problem else None
            except ConfigError as exc:
                self._errors[schema] = str(exc)
        return self._errors[schema]

    def matcher(self, schema: str) -> Any:
        """A fresh matcher, at the start of the schema's grammar."""
        matcher = self.ll.LLMatcher(self.tokenizer, self.grammar(schema))
        if matcher.is_error():
            raise ConfigError(f"the JSON schema cannot be compiled: {matcher.get_error()}")
        return matcher

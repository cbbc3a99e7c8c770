"""Drafts with no draft model (issue 43): tokens guessed to follow a sequence, which the next step computes beside
its own token and keeps as far as the model agrees (engine.py verifies: each draft row is sampled as the token at
its position would have been, and the draft is kept up to the first row whose token differs; the row there gives
the token instead). Greedy outputs are those of decoding without drafts; a sampled request's too, since a draw's
noise is keyed by its position (Sequence.draw_seed), not by how many draws came before.

Three drafters, tried in this order for each running sequence after a step:
- "grammar": the bytes a JSON schema forces next (llguidance's forced bytes: `","age":`, closing brackets),
  tokenized; the tokens llguidance itself proposes where it holds the last one back for a merge.
- "prompt": the tokens that followed the latest earlier occurrence of the sequence's last n tokens (n = 3, 2, 1)
  in its own prompt and output (prompt lookup decoding): rewrites and extractions copy their input.
- "outputs": the same over the job's finished outputs (a bounded index): one job's rows resemble each other.

Drafting pays where a step has room. `Speculation` decides from what it measures: a step's time as a plane in its
tokens and its sampled rows (t = a + b n + d s, fitted as the run goes: a draft token is a token and a sampled row,
r = b + d) and each drafter's acceptance α (a draft token's chance to be kept once the ones before it were). The
k-th token of a draft is worth its row where α^k > r B / (a + r B), the share of a step of B decoding sequences that
one row costs: where rows cost nearly all of a step (a CPU's batched decode is compute-bound from a few tens of
rows) nearly nothing is drafted; in small batches, a job's tail, and where drafts are kept (a schema's forced
keys), drafts run long. A draft's rows are decode rows (metadata.StepInputs): no chunk of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from bulkgen.engine.sequence import Sequence

DRAFTERS = ("grammar", "prompt", "outputs")
MAX_DRAFT = 8  # tokens a draft holds at most
NGRAMS = (3, 2, 1)  # the lookups' key lengths, longest first
OUTPUT_ENTRIES = 16_384  # keys the output index holds a key length (the oldest go first): about 15 MB in all
PRIOR_ACCEPTANCE = {"grammar": 0.9, "prompt": 0.5, "outputs": 0.5}
PRIOR_WEIGHT = 4.0  # the prior counts as this many verified tokens
EXPLORE_EVERY = 64  # a drafter judged not worth it still drafts one sequence in this many, to measure it again
DECAY = 0.98  # the step-time fit's forgetting, a step


class NgramIndex:
    """Where each n-gram of a token list last ended, for n in NGRAMS: the position of the token that followed
    it. Built once over a prompt, then kept up as tokens are appended."""

    def __init__(self) -> None:
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        self.length = 0  # tokens indexed

    def extend(self, token_ids: list[int]) -> None:
        """Index token_ids' new tokens (those past `length`)."""
        for j in range(max(self.length, 1), len(token_ids)):  # the n-gram ending before token j, followed by it
            for n, table in self.tables.items():
                if j >= n:
                    table[tuple(token_ids[j - n:j])] = j
        self.length = len(token_ids)

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of token_ids' last n tokens (the longest n
        found), up to `limit`."""
        for n, table in self.tables.items():
            if len(token_ids) <= n:
                continue
            found = table.get(tuple(token_ids[-n:]))
            if found is not None:
                return token_ids[found:found + limit]
        return []


class OutputIndex:
    """The job's finished outputs: for each n-gram (n in NGRAMS), the tokens that followed it the last time, up
    to MAX_DRAFT; at most OUTPUT_ENTRIES keys a length, the least recently written dropped first."""

    def __init__(self, entries: int = OUTPUT_ENTRIES) -> None:
        self.entries = entries
        self.tables: dict[int, OrderedDict[tuple[int, ...], tuple[int, ...]]] = {n: OrderedDict() for n in NGRAMS}

    def add(self, output_ids: list[int]) -> None:
        for n, table in self.tables.items():
            for j in range(n, len(output_ids)):
                key = tuple(output_ids[j - n:j])
                table[key] = tuple(output_ids[j:j + MAX_DRAFT])
                table.move_to_end(key)
            while len(table) > self.entries:
                table.popitem(last=False)

    def lookup(self, token_ids: list[int], limit: int) -> list[int]:
        for n, table in self.tables.items():
            if len(token_ids) > n and (found := table.get(tuple(token_ids[-n:]))) is not None:
                return list(found[:limit])
        return []


class Speculation:
    """Whether a draft is worth its rows now, from the step times and acceptances this run measured."""

    def __init__(self, mode: str) -> None:
        self.enabled = mode != "off"
        # exponentially weighted sums of x x^T and x t over steps, x = (1, n, m): the fit t = a + b n + c m
        self._xx = np.zeros((3, 3))
        self._xt = np.zeros(3)
        self._kept = {source: PRIOR_ACCEPTANCE[source] * PRIOR_WEIGHT for source in DRAFTERS}
        self._tried = {source: PRIOR_WEIGHT for source in DRAFTERS}
        self._skipped = dict.fromkeys(DRAFTERS, 0)

    def observe_step(self, num_tokens: int, num_sampled: int, seconds: float) -> None:
        """A step's time: its tokens (drafts' included) and its rows sampled (the LM head's and the sampler's)."""
        x = np.array([1.0, num_tokens, num_sampled])
        self._xx = self._xx * DECAY + np.outer(x, x)
        self._xt = self._xt * DECAY + x * seconds

    def observe_draft(self, source: str, drafted: int, kept: int) -> None:
        """A verified draft: `kept` of its `drafted` tokens confirmed (the first differing one ends it)."""
        self._kept[source] += kept
        self._tried[source] += kept + (kept < drafted)

    def acceptance(self, source: str) -> float:
        return self._kept[source] / self._tried[source]

    def costs(self) -> tuple[float, float, float] | None:
        """(a, b, d): a step's fixed time, a token's, a sampled row's beyond its token (the LM head, the sampler);
        None until steps of different sizes were seen."""
        xx = self._xx
        w, n, nn = xx[0, 0], xx[0, 1], xx[1, 1]
        if w < 4 or nn * w - n * n <= 1e-9 * max(nn * w, 1.0):
            return None
        ridge = 1e-9 * np.trace(xx) * np.eye(3)
        a, b, d = np.linalg.solve(xx + ridge, self._xt)
        return max(float(a), 1e-6), max(float(b), 0.0), max(float(d), 0.0)

    def plan(self, batch: int) -> dict[str, int]:
        """Each drafter's draft length worth its rows in a step of `batch` decoding sequences. A draft token costs a
        sampled row, r = b + d; a kept one is worth a sequence's share of the step, v = (a + r B) / B. The k-th
        token of a draft is drafted while acceptance^k v > r (0.5 for r / v until the fit has steps). A drafter
        judged not worth it drafts one token now and then anyway, to be measured again."""
        cost = self.costs()
        if cost is None:
            share = 0.5
        else:
            a, b, d = cost
            row = b + d
            share = row * batch / (a + row * batch)
        lengths = {}
        for source in DRAFTERS:
            alpha = self.acceptance(source)
            length, chance = 0, alpha
            while length < MAX_DRAFT and chance > share:
                length += 1
                chance *= alpha
            if length == 0:
                self._skipped[source] += 1
                length = int(self._skipped[source] % EXPLORE_EVERY == 0)
            lengths[source] = length
        return lengths


class Drafter:
    """The engine's drafts: each running sequence's, proposed after a step from the three drafters in turn.
    tokenizer: Hugging Face's (the grammar's forced bytes into tokens)."""

    def __init__(self, speculation: Speculation, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self.speculation = speculation
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.outputs = OutputIndex()
        self.num_drafted = self.num_accepted = 0
        self.by_source = {source: [0, 0] for source in DRAFTERS}  # drafted, accepted

    def propose(self, running: list[Sequence], max_new_room: Any) -> None:
        """Set each running sequence's draft (or none). max_new_room(seq): tokens it may still add."""
        if not self.speculation.enabled or not running:
            return
        lengths = self.speculation.plan(len(running))
        if not any(lengths.values()):
            return
        for seq in running:
            if not seq.num_output_tokens or seq.num_uncomputed_tokens != 1 or not draftable(seq):
                continue
            room = max_new_room(seq) - 1  # the step's own token comes after the draft's
            if room <= 0:
                continue
            draft, source = self._guess(seq, lengths, room)
            if draft:
                seq.draft, seq.draft_source = draft, source

    def _guess(self, seq: Sequence, lengths: dict[str, int], room: int) -> tuple[list[int], str]:
        if seq.matcher is not None and lengths["grammar"]:
            forced = self._forced(seq.matcher, min(lengths["grammar"], room))
            if forced:
                return forced, "grammar"
        for source in ("prompt", "outputs"):
            limit = min(lengths[source], room)
            if limit <= 0:
                continue
            index = self.index_of(seq) if source == "prompt" else self.outputs
            draft = index.lookup(seq.token_ids, limit)
            if seq.matcher is not None and draft:
                draft = draft[:seq.matcher.validate_tokens(draft)]
            if draft:
                return draft, source
        return [], ""

    def _forced(self, matcher: Any, limit: int) -> list[int]:
        """The grammar's next forced tokens: llguidance's own, then its forced bytes past them as the tokenizer
        writes them (llguidance holds back a token that could merge with what the model writes next; the
        verification decides)."""
        if matcher.is_stopped():
            return []
        tokens = list(matcher.compute_ff_tokens())
        forced = matcher.compute_ff_bytes()
        done = len(self.tokenizer.decode(tokens).encode()) if tokens else 0
        rest = forced[done:]
        if rest:
            try:
                text = rest.decode()
            except UnicodeDecodeError:
                text = ""
            if text:
                tokens += self.tokenizer.encode(text, add_special_tokens=False)
        tokens = tokens[:limit]
        return tokens[:matcher.validate_tokens(tokens)] if tokens else []

    def index_of(self, seq: Sequence) -> NgramIndex:
        if seq.ngrams is None:
            seq.ngrams = NgramIndex()
        seq.ngrams.extend(seq.token_ids)
        return seq.ngrams

    def verified(self, seq: Sequence, drafted: int, kept: int) -> None:
        self.speculation.observe_draft(seq.draft_source, drafted, kept)
        self.num_drafted += drafted
        self.num_accepted += kept
        counts = self.by_source[seq.draft_source]
        counts[0] += drafted
        counts[1] += kept

    def finished(self, seq: Sequence, keep_output: bool) -> None:
        seq.ngrams = None
        if keep_output and self.speculation.enabled:
            self.outputs.add([t for t in seq.output_token_ids if t not in self.eos_token_ids])


def draftable(seq: Sequence) -> bool:
    """Whether a sequence's rows can be sampled from one step's logits: penalties read the tokens before a row,
    which a draft's rows would not yet hold."""
    p = seq.params
    return p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty

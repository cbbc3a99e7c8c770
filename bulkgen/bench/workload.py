"""Benchmark workloads: a Parquet file (as from make_workload.py) or a synthetic one, as token ids."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from bulkgen.errors import InputError
from bulkgen.model import chat_prompt
from bulkgen.store.packings import ids_bytes, shared_tokens


@dataclass
class Workload:
    name: str
    ids: list[str]
    prompts: list[list[int]]  # token ids
    max_new_tokens: list[int]
    texts: list[str] | None = None  # the prompts as text, when the workload came as text

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    @property
    def num_distinct_prompt_tokens(self) -> int:
        """The prompts' tokens, each prefix they share counted once."""
        return distinct_tokens(self.prompts)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls(**json.loads(path.read_text()))

    def describe(self) -> dict:
        lengths = [len(p) for p in self.prompts]
        return {"name": self.name, "num_requests": len(self.prompts), "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens,
                "num_distinct_prompt_tokens": self.num_distinct_prompt_tokens, "prompt_tokens_min": min(lengths),
                "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1), "prompt_tokens_max": max(lengths)}


def from_parquet(path: Path, tokenizer, limit: int | None = None, prompt_column: str = "prompt",
                 max_new_tokens: int = 128, chat: bool = False) -> Workload:
    """Rows of `prompt` (already chat-formatted text, tokenized without special tokens; or, with `chat`,
    plain instructions rendered as a user message) and, if present, `max_new_tokens` and `id`."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise InputError(f"cannot read workload {path}: {exc}") from exc
    if prompt_column not in table.column_names:
        raise InputError(f"workload {path} has no column {prompt_column!r}; its columns: {table.column_names}")
    if limit:
        table = table.slice(0, limit)
    texts = table.column(prompt_column).to_pylist()
    budgets = (table.column("max_new_tokens").to_pylist() if "max_new_tokens" in table.column_names
               else [max_new_tokens] * len(texts))
    ids = (table.column("id").to_pylist() if "id" in table.column_names else [str(i) for i in range(len(texts))])
    if chat:
        texts = [chat_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return Workload(Path(path).name, [str(i) for i in ids], prompts, [int(b) for b in budgets], texts)


def synthetic(num_requests: int, vocab_size: int, seed: int = 0) -> Workload:
    """Like make_workload.py's shape without its text: prompt lengths log-uniform over 60..1400 tokens,
    max_new_tokens uniform over 16..256, random token ids."""
    rng = random.Random(seed)
    prompts, budgets = [], []
    for _ in range(num_requests):
        length = int(round(math.exp(rng.uniform(math.log(60), math.log(1400)))))
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length)])
        budgets.append(rng.randint(16, 256))
    return Workload(f"synthetic-{num_requests}-seed{seed}", [f"syn-{i:05d}" for i in range(num_requests)],
                    prompts, budgets)


LICENSE_DIR = Path("/usr/share/common-licenses")
TASKS = ("Summarize the following passage in plain words.",
         "List the key obligations stated in this text.",
         "Rewrite this passage for a ten-year-old.",
         "Write three quiz questions about this text.")


def make_workload(tokenizer, num_requests: int, out: Path, seed: int = 0) -> dict[str, int]:
    """Write the benchmarks' reproducible workload as Parquet (the same file as the shared bench folder's
    make_workload.py for the same model, N and seed): chat-formatted instructions over passages of the
    license texts every Debian system has (16..1024 words, log-uniform), max_new_tokens uniform over
    16..256. Columns: id, prompt, max_new_tokens, prompt_tokens. Returns its token counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = _license_words()
    rng = random.Random(seed)
    rows: dict[str, list] = {"id": [], "prompt": [], "max_new_tokens": [], "prompt_tokens": []}
    for i in range(num_requests):
        num_words = int(round(2 ** rng.uniform(4, 10)))
        start = rng.randrange(0, len(words) - num_words)
        instruction = f"{rng.choice(TASKS)}\n\n{' '.join(words[start:start + num_words])}"
        text = chat_prompt(tokenizer, [{"role": "user", "content": instruction}])
        rows["id"].append(f"req-{i:05d}")
        rows["prompt"].append(text)
        rows["max_new_tokens"].append(rng.randint(16, 256))
        rows["prompt_tokens"].append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    pq.write_table(pa.table(rows), out)
    return {"num_requests": num_requests, "num_prompt_tokens": sum(rows["prompt_tokens"]),
            "num_output_tokens": sum(rows["max_new_tokens"])}


QUESTIONS = ("What is the main subject of the text above?", "Which party does the text above protect most?",
             "Quote one sentence of the text above that sets a condition.", "Is copying allowed by the text above?",
             "Name one obligation the text above places on a distributor.", "What does the text above say about "
             "warranty?", "Summarize the text above in one sentence.", "Which word of the text above is the rarest?")


def make_shared_prefix(tokenizer, out: Path, num_prefixes: int = 8, prefix_tokens: int = 1000, questions: int = 40,
                       seed: int = 0, max_new_tokens: tuple[int, int] = (16, 48)) -> dict[str, int]:
    """A few-shot job: `num_prefixes` documents of about `prefix_tokens` tokens each (passages of the license
    texts), each asked `questions` questions (the document first, the question after it, as a chat's user
    message), rows shuffled; budgets uniform over `max_new_tokens`. Columns as make_workload's, and `prefix` (which
    document). Returns its token counts, `num_distinct_prompt_tokens` among them (the prompts' tokens counted
    once for every prefix they share: what a job computes at best)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = _license_words()
    rng = random.Random(seed)
    rows: dict[str, list] = {"id": [], "prompt": [], "max_new_tokens": [], "prompt_tokens": [], "prefix": []}
    tokens: list[list[int]] = []
    for p in range(num_prefixes):
        num_words = max(1, int(prefix_tokens * 0.72))  # the license texts run ~1.4 tokens a word
        start = rng.randrange(0, len(words) - num_words)
        document = " ".join(words[start:start + num_words])
        for q in range(questions):
            question = f"{rng.choice(QUESTIONS)} (question {q + 1})"
            text = chat_prompt(tokenizer, [{"role": "user", "content": f"{document}\n\n{question}"}])
            rows["prompt"].append(text)
            rows["max_new_tokens"].append(rng.randint(*max_new_tokens))
            tokens.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            rows["prompt_tokens"].append(len(tokens[-1]))
            rows["prefix"].append(p)
    order = list(range(len(tokens)))
    rng.shuffle(order)
    table = {name: [column[i] for i in order] for name, column in rows.items() if name != "id"}
    table["id"] = [f"req-{i:05d}" for i in range(len(order))]
    pq.write_table(pa.table(table), out)
    return {"num_requests": len(order), "num_prompt_tokens": sum(rows["prompt_tokens"]),
            "num_distinct_prompt_tokens": distinct_tokens(tokens), "num_output_tokens": sum(rows["max_new_tokens"])}


def distinct_tokens(prompts: list[list[int]]) -> int:
    """Tokens of `prompts` counted once for every prefix they share (the nodes of their trie): sorted, each prompt
    adds what it does not share with the one before it."""
    ordered = sorted(ids_bytes(p) for p in prompts)
    return sum(len(b) // 4 - shared_tokens(a, b) for a, b in zip([b"", *ordered], ordered, strict=False))


def _license_words() -> list[str]:
    words: list[str] = []
    for path in sorted(LICENSE_DIR.glob("*")):
        if path.is_file():
            words += path.read_text(encoding="utf-8", errors="ignore").split()
    if not words:
        raise InputError(f"no license texts in {LICENSE_DIR} to cut passages from (Debian's base-files has them)")
    return words

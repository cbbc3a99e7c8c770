"""Workloads where drafts pay (issue 43), written as Parquet for `bulkgen bench ... --chat`:

    python tools/draft_workloads.py extraction OUT.parquet SCHEMA.json [--rows 256] [--seed 0]
    python tools/draft_workloads.py rewrite OUT.parquet [--rows 64] [--seed 0]

extraction: a short made-up biography a row, to be read out as JSON of SCHEMA's eight named fields (the schema
is written beside it: give it to `bench --json-schema SCHEMA.json --compare bulkgen@json,...`).
rewrite: a paragraph a row to be copied with its spelling fixed (the output copies most of the prompt), with a
budget about the paragraph's length (`bench` masks EOS: past the copy a model writes anything).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FIRST = ["Anna", "Omar", "Lena", "Jonas", "Priya", "Carlos", "Mei", "Tom", "Sara", "Ivan", "Fatima", "Lucas"]
LAST = ["Berg", "Haddad", "Novak", "Silva", "Tanaka", "Okafor", "Meyer", "Rossi", "Kaur", "Dubois", "Lind"]
CITIES = [("Lyon", "France"), ("Porto", "Portugal"), ("Osaka", "Japan"), ("Leeds", "England"), ("Graz", "Austria"),
          ("Austin", "USA"), ("Pune", "India"), ("Cork", "Ireland"), ("Bergen", "Norway"), ("Quito", "Ecuador")]
JOBS = ["nurse", "baker", "pilot", "teacher", "engineer", "chemist", "architect", "librarian", "welder", "editor"]
EMPLOYERS = ["Northwind", "Acme", "Globex", "Initech", "Umbrella", "Stark Labs", "Wayne Foods", "Hooli"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30},
        "occupation": {"type": "string", "maxLength": 30}, "employer": {"type": "string", "maxLength": 30},
        "email": {"type": "string", "maxLength": 60}, "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "country", "occupation", "employer", "email", "married"],
    "additionalProperties": False,
}

TEXT = ("The old harbour town wakes up early. Fishermen carry their nets down to the boats while the bakers open "
        "their doors and the smell of fresh bread fills the narrow streets. By noon the market is full of "
        "visitors who come for the fish, the cheese and the view of the bay. In the evening the lights of the "
        "cafes come on one by one and the town grows quiet again.").split()
TYPOS = {"harbour": "harbuor", "early": "erly", "Fishermen": "Fisharmen", "their": "thier", "boats": "boots",
         "bakers": "bakres", "bread": "braed", "streets": "streeets", "market": "markit", "visitors": "visiters",
         "cheese": "cheeze", "evening": "evenning", "lights": "ligths", "quiet": "quite"}


def extraction(rows: int, rng: random.Random) -> list[str]:
    prompts = []
    for _ in range(rows):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        city, country = rng.choice(CITIES)
        job, employer, age = rng.choice(JOBS), rng.choice(EMPLOYERS), rng.randint(21, 70)
        married = rng.random() < 0.5
        email = f"{first.lower()}.{last.lower()}@{employer.split()[0].lower()}.com"
        bio = (f"{first} {last} is a {age}-year-old {job} who lives in {city}, {country}. {first} works for "
               f"{employer} and can be reached at {email}. {'They are married.' if married else 'They are single.'}")
        prompts.append(f"Extract the person's details from this text as JSON with the fields name, age, city, "
                       f"country, occupation, employer, email and married.\n\n{bio}")
    return prompts


def rewrite(rows: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """The prompts, and a budget each about the paragraph's length in tokens (the copy, not what follows it)."""
    prompts, budgets = [], []
    for _ in range(rows):
        start = rng.randrange(0, len(TEXT) // 3)
        words = TEXT[start:start + rng.randint(30, len(TEXT) - start)]
        noisy = [TYPOS[w] if w in TYPOS and rng.random() < 0.6 else w for w in words]
        prompts.append("Rewrite this paragraph with its spelling mistakes fixed. Write only the paragraph.\n\n"
                       + " ".join(noisy))
        budgets.append(int(1.2 * len(words)))
    return prompts, budgets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["extraction", "rewrite"])
    parser.add_argument("out", type=Path)
    parser.add_argument("schema", type=Path, nargs="?")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if args.kind == "extraction":
        if args.schema is None:
            parser.error("extraction: give SCHEMA.json, where the schema is written")
        columns = {"prompt": extraction(args.rows or 256, rng)}
        args.schema.write_text(json.dumps(SCHEMA))
    else:
        prompts, budgets = rewrite(args.rows or 64, rng)
        columns = {"prompt": prompts, "max_new_tokens": budgets}
    pq.write_table(pa.table(columns), args.out)
    prompts = columns["prompt"]
    print(f"wrote {len(prompts)} rows to {args.out}")


if __name__ == "__main__":
    main()

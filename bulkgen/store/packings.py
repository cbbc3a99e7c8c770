"""The packings' orders, as the store claims by them: each packing's (field, descending) sort keys, ties kept
in input order. The one definition: models.py builds a claim index from each (so they cannot disagree),
queue.claim orders by it in SQL, and packing.order applies it to lists. No SQLAlchemy here, so that the
engine's side (the packer, the bench, the GPU suite) imports it on a machine without the database packages.
"""

SORT_KEYS: dict[str, tuple[tuple[str, bool], ...]] = {
    "lpt": (("max_new_tokens", True), ("num_prompt_tokens", True)),
    "sorted": (("num_prompt_tokens", False),),
    "fifo": (),
}
PACKINGS = tuple(SORT_KEYS)
DEFAULT_PACKING = "lpt"

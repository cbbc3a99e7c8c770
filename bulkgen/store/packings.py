"""The packings' orders, as the store claims by them: each packing's (field, descending) sort keys, ties kept
in input order. The one definition: packing.order applies them to lists; lpt's also keeps the requests that share
a prompt prefix together (`prefix_order`), which the store ranks once a job is submitted (`lpt_rank`, a request's
place in that order). models.py builds a claim index from each packing's CLAIM_KEYS (so they cannot disagree) and
queue.claim orders by them in SQL. No SQLAlchemy here, so that the engine's side (the packer, the bench, the GPU
suite) imports it on a machine without the database packages.
"""

from array import array
from collections.abc import Sequence
from typing import Any

SORT_KEYS: dict[str, tuple[tuple[str, bool], ...]] = {
    "lpt": (("max_new_tokens", True), ("num_prompt_tokens", True)),
    "sorted": (("num_prompt_tokens", False),),
    "fifo": (),
}
# what a claim orders by: lpt by the rank store/jobs.open_job gives each request (SORT_KEYS, prefix groups kept)
CLAIM_KEYS: dict[str, tuple[tuple[str, bool], ...]] = {**SORT_KEYS, "lpt": (("lpt_rank", False),)}
PACKINGS = tuple(SORT_KEYS)
DEFAULT_PACKING = "lpt"


MIN_SHARED_TOKENS = 64  # what a prefix must share beyond its parent's to make a group (4 blocks of 16)


def ids_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as the store packs them (little-endian int32): equal prefixes of ids are equal prefixes of bytes."""
    return array("i", token_ids).tobytes()


def prefix_order(keys: Sequence[Any], prompts: Sequence[bytes], min_shared: int = MIN_SHARED_TOKENS,
                 group_ends: list[int] | None = None) -> list[int]:
    """The positions of requests in the order of their `keys`, except that requests whose prompts (token ids as
    `ids_bytes`) share a prefix of `min_shared` tokens more than the group around them form a group, which runs
    as one: its members back to back, in key order, at the place of its first member's key. Groups nest (a system
    prompt shared by all, a document shared by its questions, `--n` samples of one prompt). Without shared prefixes
    this is `sorted(keys)`.

    Why: the prefix cache keeps a prefix's blocks only while no other request needs the memory, so a prefix is
    reused by the requests that run near its first one; in longest-output-first order, the questions of one
    document are spread over the whole job and each recomputes it (BENCHMARKS.md, issue 42).

    How: the prompts sorted as bytes put every set of prompts sharing a prefix in one run; the common prefixes of
    neighbours give the runs' tree (an LCP-interval tree, built with a stack in one pass); each node is closed
    bottom-up into its members' order, and kept as one group where its prefix is `min_shared` tokens longer than its
    parent's, dissolved into its parent otherwise.

    group_ends, where given, is filled with each request's end of its innermost group: the place in the order just
    past the group's last member (its own place + 1 where it is in no group), so that a claim can take a group
    whole (queue.claim)."""
    n = len(keys)
    innermost: list[list[int] | None] = [None] * n
    by_prompt = sorted(range(n), key=prompts.__getitem__)
    stack: list[tuple[int, list[tuple[Any, list[int]]]]] = [(0, [])]  # open nodes: (shared tokens, items)
    previous = None
    for i in by_prompt:
        if previous is not None:
            shared = shared_tokens(prompts[previous], prompts[i])
            closed = None
            while stack[-1][0] > shared:
                depth, items = stack.pop()
                items.extend(closed or ())
                closed = _close(depth, items, max(stack[-1][0], shared), min_shared, innermost)
            if stack[-1][0] < shared:
                stack.append((shared, closed if closed is not None else [stack[-1][1].pop()]))
            else:
                stack[-1][1].extend(closed or ())
        stack[-1][1].append((keys[i], [i]))
        previous = i
    closed = None
    while len(stack) > 1:
        depth, items = stack.pop()
        items.extend(closed or ())
        closed = _close(depth, items, stack[-1][0], min_shared, innermost)
    root = stack[0][1] + (closed or [])
    root.sort(key=lambda item: item[0])
    ordered = [i for _, members in root for i in members]
    if group_ends is not None:
        place = {i: rank for rank, i in enumerate(ordered)}
        group_ends[:] = [place[group[-1]] + 1 if group is not None else place[i] + 1
                         for i, group in enumerate(innermost)]
    return ordered


def _close(depth: int, items: list[tuple[Any, list[int]]], parent_depth: int, min_shared: int,
           innermost: list[list[int] | None]) -> list[tuple[Any, list[int]]]:
    items.sort(key=lambda item: item[0])
    if depth - parent_depth < min_shared:
        return items
    group = [i for _, members in items for i in members]
    for i in group:
        if innermost[i] is None:  # inner groups close first
            innermost[i] = group
    return [(items[0][0], group)]


def shared_tokens(a: bytes, b: bytes) -> int:
    """Tokens two prompts (as `ids_bytes`) share at their start: a binary search over slices compared in C."""
    low, high = 0, min(len(a), len(b)) // 4
    while low < high:
        mid = (low + high + 1) // 2
        if a[:4 * mid] == b[:4 * mid]:
            low = mid
        else:
            high = mid - 1
    return low

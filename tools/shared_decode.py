"""One layer's decode attention in C, one sequence at a time against work items of sequences that share blocks
(paged_decode_shared): 160 sequences, 8 documents of 58 blocks of 16 tokens, 20 questions each with 1-20 tokens
of their own, float32, 2 threads; ms a call, the best of 5 runs of 10 calls each side.

    python tools/shared_decode.py 3 3            # SmolLM2-135M's heads (3 KV heads, 3 query heads each)
    python tools/shared_decode.py 8 4 sorted     # the 1B shape's, the sequences in document order
    DOCS=32 python tools/shared_decode.py 3 3    # 32 documents: 4x the shared blocks, past a 32 MB L3
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

from bulkgen.engine.cpu.attention import decode_c, shared_items
from bulkgen.engine.cpu.kernels import load_cpu_kernels
from bulkgen.engine.metadata import FULL, CpuMetadata, k_block_shape


def main() -> None:
    torch.set_num_threads(2)
    kv_heads, group, head_dim, block_size = int(sys.argv[1]), int(sys.argv[2]), 64, 16
    docs, per_doc, doc_blocks, own = int(os.environ.get("DOCS", 8)), 20, 58, 2
    num_blocks = docs * doc_blocks + docs * per_doc * own
    k = torch.randn(num_blocks, *k_block_shape(kv_heads, head_dim, block_size, torch.float32))
    v = torch.randn(num_blocks, kv_heads, block_size, head_dim)
    rows, lens, free = [], [], docs * doc_blocks
    for d in range(docs):
        for i in range(per_doc):
            rows.append(list(range(d * doc_blocks, (d + 1) * doc_blocks)) + [free, free + 1])
            lens.append(doc_blocks * block_size + 1 + i)
            free += own
    order = np.arange(len(rows)) if "sorted" in sys.argv[3:] else np.random.default_rng(0).permutation(len(rows))
    tables = torch.tensor([rows[i] for i in order], dtype=torch.int32)
    lens_t = torch.tensor([lens[i] for i in order], dtype=torch.int32)
    q = torch.randn(len(rows), kv_heads * group, head_dim)
    meta = CpuMetadata(k_caches=[k], v_caches=[v], slots=None, slot_blocks=None, slot_offsets=None,
                       num_decode_tokens=len(rows), decode_block_tables=tables, decode_context_lens=lens_t,
                       decode_max_context_len=int(lens_t.max()), decode_kernel=load_cpu_kernels(), num_threads=2)
    items = shared_items(tables.numpy(), lens_t.tolist(), block_size)
    best: dict[str, float] = {}
    for name, shared in (("one at a time", None), ("shared items", items)) * 5:
        meta.decode_shared = shared
        decode_c(meta, q, k, v, head_dim**-0.5, FULL)
        start = time.perf_counter()
        for _ in range(10):
            decode_c(meta, q, k, v, head_dim**-0.5, FULL)
        best[name] = min(best.get(name, float("inf")), (time.perf_counter() - start) * 100)
    for name, ms in best.items():
        print(f"{name}: {ms:.2f} ms (the best of 5 runs of 10 calls)")


if __name__ == "__main__":
    main()

"""The engine alone, for a before/after of a change that must not move its speed (BENCHMARKS.md, "The house"):
`Engine.generate` over the first 48 prompts of a workload file, 64 sampled tokens each (T 0.8, top-p 0.95,
seeded), after a 4-prompt warm-up; prints output tokens a second. Run each tree from its own checkout
(`cd TREE && PYTHONPATH=TREE python tools/engine_speed.py w128.parquet`), alternately, one process at a time."""

from __future__ import annotations

import argparse
import time

import pyarrow.parquet as pq

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.resolve import DEFAULT_MODEL, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("workload", help="a Parquet file with a prompt column (bulkgen bench make-workload)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = pq.read_table(args.workload, columns=["prompt"]).column("prompt").to_pylist()
    engine = Engine(resolve_model(DEFAULT_MODEL).path, EngineConfig())
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.8, top_p=0.95, seed=0, ignore_eos=True)
    list(engine.generate(prompts[:4], params))
    start = time.perf_counter()
    outputs = list(engine.generate(prompts[:args.requests], params))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.output_token_ids) for o in outputs)
    print(f"{tokens / seconds:.1f} output tok/s ({tokens} tokens, {seconds:.1f} s; {engine.describe()})")


if __name__ == "__main__":
    main()

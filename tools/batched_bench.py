"""bulkgen on llama.cpp's `llama-batched-bench` workload: NPL sequences, each of NPP prompt tokens and NTG generated
tokens, all submitted at once; prints the total tokens a second as llama-batched-bench's `S t/s` column counts
them ((NPP + NTG) x NPL over the whole time, the load excluded).

    python tools/batched_bench.py MODEL [--npp 288] [--ntg 144] [--npl 16,64] [--quantization gguf] [--dtype auto]

Against `llama-batched-bench -m FILE.gguf -c CTX -b 2048 -ub 512 -npp 288 -ntg 144 -npl 16,64 -t 2` on the same
file (BENCHMARKS.md). Prompts are random token ids (seeded), the EOS token ignored, greedy.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.resolve import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--npp", type=int, default=288)
    parser.add_argument("--ntg", type=int, default=144)
    parser.add_argument("--npl", default="16,64")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = Engine(resolve_model(args.model).path, EngineConfig(quantization=args.quantization, dtype=args.dtype))
    print(engine.describe(), flush=True)
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(0)
    for npl in (int(n) for n in args.npl.split(",")):
        prompts = [[rng.randrange(100, vocab - 1) for _ in range(args.npp)] for _ in range(npl)]
        params = SamplingParams(max_new_tokens=args.ntg, ignore_eos=True)
        start = time.perf_counter()
        outputs = list(engine.generate(prompts, params))
        elapsed = time.perf_counter() - start
        assert all(len(o.output_token_ids) == args.ntg for o in outputs)
        print(json.dumps({"npp": args.npp, "ntg": args.ntg, "npl": npl, "seconds": round(elapsed, 2),
                          "total_tok_s": round(npl * (args.npp + args.ntg) / elapsed, 1)}), flush=True)


if __name__ == "__main__":
    main()

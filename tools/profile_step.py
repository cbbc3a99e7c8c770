"""Where a bulkgen run's time goes, by phase (the profile of BENCHMARKS.md, issue 38).

Runs the engine in process over a workload (greedy, EOS masked, as `bulkgen bench` does) with timers around
the lean forward's pieces: linear layers, the gated MLP input, the LM head, decode and prefill attention, the
KV write, the small ops; and what is left of a step (inputs, scheduling, sampling). The C kernels and torch
run synchronously on a CPU, so each timer is the piece's own time.

    python tools/profile_step.py MODEL WORKLOAD.parquet DTYPE [LIMIT]

MODEL: a Hugging Face directory; BULKGEN_KERNELS picks paths as usual; BS=N sets the KV block size; QUANT=int8
(or gguf, none) sets --quantization.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bulkgen.bench.workload import from_parquet
from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine import attention, layers, llama, quant
from bulkgen.engine.cpu import ops as cpu_ops
from bulkgen.engine.engine import Engine

SECONDS: dict[str, float] = collections.defaultdict(float)
_depth = [0]


def timed(name_of: Callable[[tuple], str], function: Callable, outer: bool = False) -> Callable:
    """function, its seconds added to SECONDS[name_of(args)]; nested calls of timed pieces count once, in
    the outermost (outer=True: a frame around pieces, always counted)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _depth[0] and not outer:
            return function(*args, **kwargs)
        _depth[0] += not outer
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SECONDS[name_of(args)] += time.perf_counter() - start
            _depth[0] -= not outer
    return wrapper


def main() -> None:
    model, path, dtype = sys.argv[1:4]
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    workload = from_parquet(Path(path), AutoTokenizer.from_pretrained(model), limit=limit)
    engine = Engine(model, EngineConfig(dtype=dtype, block_size=int(os.environ.get("BS", "32")),
                                          quantization=os.environ.get("QUANT", "auto")))
    runner = engine.runner
    if runner.forward is None:
        sys.exit("the model runs through Hugging Face's modules: this profile times the lean forward only")
    head = runner.forward.lm_head
    layers.Linear.__call__ = timed(lambda a: "lm_head" if a[0] is head else "linear", layers.Linear.__call__)
    layers.GatedLinear.__call__ = timed(lambda a: "gated_mlp", layers.GatedLinear.__call__)
    quant.Int8Linear.__call__ = timed(lambda a: "linear", quant.Int8Linear.__call__)
    quant.SiluMulAfter.__call__ = timed(lambda a: "gated_mlp", quant.SiluMulAfter.__call__)
    quant.Int8GatedLinear.__call__ = timed(lambda a: "gated_mlp", quant.Int8GatedLinear.__call__)
    attention.decode_c = timed(lambda a: "attn_decode", attention.decode_c, outer=True)
    attention.decode_torch = timed(lambda a: "attn_decode", attention.decode_torch, outer=True)
    attention.prefill_c = timed(lambda a: "attn_prefill", attention.prefill_c, outer=True)
    attention.write_kv = timed(lambda a: "attn_write_kv", attention.write_kv, outer=True)
    attention.gather_k = timed(lambda a: "attn_prefill_gather", attention.gather_k, outer=True)
    attention.F.scaled_dot_product_attention = timed(lambda a: "attn_prefill",
                                                     attention.F.scaled_dot_product_attention, outer=True)
    llama.attention.attend = timed(lambda a: "attend", attention.attend)
    for name in ("add_rms_norm", "rope", "silu_mul"):
        setattr(cpu_ops.Ops, name, timed(lambda a: "small_ops", getattr(cpu_ops.Ops, name)))
    runner.execute = timed(lambda a: "execute", runner.execute, outer=True)
    runner.forward = timed(lambda a: "forward", runner.forward, outer=True)
    print(engine.describe())
    for i, prompt in enumerate(workload.prompts):
        engine.add(i, prompt, SamplingParams(max_new_tokens=workload.max_new_tokens[i], ignore_eos=True))
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        SECONDS["step"] += time.perf_counter() - t
        steps += 1
    wall = time.perf_counter() - start
    print(f"wall {wall:.1f} s, {steps} steps, {sum(workload.max_new_tokens) / wall:.1f} output tok/s")
    s = SECONDS
    parts = ("attn_decode", "attn_prefill", "attn_write_kv", "attn_prefill_gather")
    rows = [(k, s[k]) for k in ("linear", "gated_mlp", "lm_head", *parts)]
    rows += [("attend, the rest", s["attend"] - sum(s[k] for k in parts)), ("small_ops", s["small_ops"]),
             ("forward, the rest (embedding, rotary)",
              s["forward"] - sum(s[k] for k in ("linear", "lm_head", "gated_mlp", "attend", "small_ops"))),
             ("execute outside the forward (inputs)", s["execute"] - s["forward"]),
             ("step outside execute (schedule, sample, detokenize)", s["step"] - s["execute"])]
    for name, seconds in rows:
        print(f"  {name:52s} {seconds:7.2f} s {100 * seconds / wall:5.1f} %")


if __name__ == "__main__":
    main()

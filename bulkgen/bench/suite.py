"""`bulkgen bench --suite gpu`: one command that measures a GPU, with nothing to download.

Models are built from configs written here (the shapes of SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B),
with random weights drawn from one seed on the device, so every engine of the run computes with the same
weights; bfloat16; a synthetic workload (prompts of 128-1,024 random tokens, 128-512 output tokens, EOS
masked). bulkgen runs every request; the Hugging Face peers (transformers' `generate_batch`, its paged
continuous batching; `generate` on static batches sorted by length) run the first `peer_requests` of them,
which is enough for a rate and keeps the suite within minutes. Each engine runs in its own process.

Beside output tokens a second, the table gives bulkgen's decode step time at its largest batch against
that step's roofline: the bytes it must read (weights, and the KV of every sequence) over the device's
memory bandwidth, or its FLOPs over the device's peak, whichever is longer; both measured at the start.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bulkgen.bench.workload import Workload
from bulkgen.model import DTYPE_BYTES, ModelShape, estimated_weight_count

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SUITE_MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False),
    # two layers of nothing much: the suite's own test, on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=4096,
                 tie_word_embeddings=False),
}
GPU_MODELS = ("llama-3.1-8b", "llama-3.2-1b", "smollm2-135m")  # the largest first: the figure that matters most
SUITE_ENGINES = ("bulkgen", "hf-cb", "hf-static-sorted")
SUITE_RUNNERS = (*SUITE_ENGINES, "bulkgen-graphs", "hf-static")  # what --suite-engines may name (bench/child.py)


def suite_workload(num_requests: int, vocab_size: int, prompt_tokens: tuple[int, int] = (128, 1024),
                   output_tokens: tuple[int, int] = (128, 512), seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_tokens))]
               for _ in range(num_requests)]
    budgets = [rng.randint(*output_tokens) for _ in range(num_requests)]
    return Workload(f"suite-{num_requests}", [f"s-{i:05d}" for i in range(num_requests)], prompts, budgets)


def build_model(name: str, dtype: Any, device: Any, seed: int = 0) -> Any:
    """The suite model `name` with random weights, on `device`: the same weights for the same seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SUITE_MODELS[name], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class NullTokenizer:
    """What the engine needs of a tokenizer when outputs are compared as token ids: no text."""

    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def run_suite(models: list[str], num_requests: int, peer_requests: int, engines: list[str], engine_config: dict,
              run_child: Callable[[str, dict[str, Any]], dict[str, Any]], log: Callable[[str], None],
              prompt_tokens: tuple[int, int] = (128, 1024), output_tokens: tuple[int, int] = (128, 512),
              on_row: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Each model through each engine (run_child(engine, spec) runs one in its own process); rows for the
    table, with token agreement against the first Hugging Face engine over the requests both ran. on_row gets
    the report so far the moment each engine finishes (a run cut short keeps what it measured); an engine that
    fails gives a row with its error and the next one runs."""
    rows: list[dict[str, Any]] = []
    report = {"suite": "gpu", "models": models, "num_requests": num_requests, "peer_requests": peer_requests,
              "prompt_tokens": list(prompt_tokens), "output_tokens": list(output_tokens), "rows": rows}
    with tempfile.TemporaryDirectory(prefix="bulkgen-suite-") as tmp:
        for name in models:
            workload = suite_workload(num_requests, SUITE_MODELS[name]["vocab_size"], prompt_tokens, output_tokens)
            results = []
            for engine in engines:
                subset = workload if engine.startswith("bulkgen") else _first(workload, peer_requests)
                path = Path(tmp) / f"{name}-{engine}.json"
                subset.save(path)
                log(f"suite: {name} through {engine} ({len(subset.prompts)} requests) ...")
                raw = run_child(engine, {"engine": engine, "suite_model": name, "workload": str(path),
                                         "dtype": engine_config.get("dtype", "bfloat16"),
                                         "engine_config": engine_config})
                results.append(_row(name, engine, subset, raw))
                _agreement(results)
                rows.append(results[-1])
                log(f"suite: {name} {engine}: {results[-1].get('output_tok_per_s') or raw.get('error')}")
                if on_row is not None:
                    on_row(report)
    return report


def _first(workload: Workload, n: int) -> Workload:
    return Workload(workload.name, workload.ids[:n], workload.prompts[:n], workload.max_new_tokens[:n])


def _row(model: str, engine: str, workload: Workload, raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("error"):
        return {"model": model, "engine": engine, "error": raw["error"]}
    tokens = raw["output_token_ids"]
    row = {"model": model, "engine": engine, "num_requests": len(tokens),
           "output_tok_per_s": sum(len(t) for t in tokens) / raw["wall_s"], "wall_s": raw["wall_s"],
           "_tokens": tokens}
    row.update(raw.get("decode") or {})
    return row


def _agreement(results: list[dict[str, Any]]) -> None:
    reference = next((r for r in results if r["engine"].startswith("hf-") and "_tokens" in r), None)
    for r in results:
        if reference is None or "_tokens" not in r:
            continue
        pairs = list(zip(r["_tokens"], reference["_tokens"], strict=False))
        r["identical_share"] = sum(a == b for a, b in pairs) / len(pairs)
        r["reference"] = reference["engine"]


def decode_roofline(steps: list[list[Any]], shape: ModelShape, dtype: str,
                    device_info: dict[str, float]) -> dict[str, Any] | None:
    """bulkgen's decode step time at its largest batch (the median of the decode-only steps there) and that
    step's roofline, from the model's shape (its config, not the loaded modules: the lean forward moves the
    weights out of them): every weight read once but the embedding table's (rows gathered), and the KV of every
    sequence's context. steps: [time, batched tokens, decode tokens, sequences, kv usage, context tokens]."""
    durations = [(steps[i][3], steps[i][0] - steps[i - 1][0], steps[i][5]) for i in range(1, len(steps))
                 if steps[i][1] == steps[i][2] == steps[i][3]]  # decode only: one token a sequence
    if not durations:
        return None
    batch = max(b for b, _, _ in durations)
    at_batch = sorted((d, ctx) for b, d, ctx in durations if b >= 0.9 * batch)
    seconds, context = at_batch[len(at_batch) // 2]
    weight_params = estimated_weight_count(shape) - shape.vocab * shape.hidden  # the embedding table is gathered
    kv_bytes = shape.kv_bytes_per_token(dtype) * context
    flops = 2 * weight_params * batch + 4 * shape.num_layers * shape.num_heads * shape.head_dim * context
    memory_s = (weight_params * DTYPE_BYTES[dtype] + kv_bytes) / device_info["bytes_per_s"]
    compute_s = flops / device_info["flops_per_s"]
    roofline = max(memory_s, compute_s)
    return {"decode_batch": batch, "decode_step_ms": seconds * 1e3, "roofline_ms": roofline * 1e3,
            "step_over_roofline": seconds / roofline, "bound": "memory" if memory_s >= compute_s else "compute"}


def measure_device(device: Any, dtype: Any) -> dict[str, float]:
    """The device's copy bandwidth (bytes read + written a second) and matmul rate in `dtype`."""
    import time

    import torch

    def timed(fn: Callable[[], object], reps: int) -> float:
        fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        return (time.perf_counter() - start) / reps

    size = 2**30 if device.type == "cuda" else 2**26
    src, dst = torch.empty(size, dtype=torch.uint8, device=device), torch.empty(size, dtype=torch.uint8, device=device)
    bandwidth = 2 * size / timed(lambda: dst.copy_(src), 10)
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    flops = 2 * n**3 / timed(lambda: a @ b, 10)
    return {"bytes_per_s": bandwidth, "flops_per_s": flops}


def format_suite(report: dict[str, Any]) -> str:
    header = (f"{'model':<14} {'engine':<17} {'requests':>8} {'out tok/s':>10} {'decode step':>16} "
              f"{'roofline':>9} {'ratio':>6} {'identical':>9}")
    lines = [header, "-" * len(header)]
    for r in report["rows"]:
        if r.get("error"):
            lines.append(f"{r['model']:<14} {r['engine']:<17} failed: {r['error'][:80]}")
            continue
        step = f"{r['decode_step_ms']:.2f} ms @{r['decode_batch']}" if "decode_step_ms" in r else "-"
        roof = f"{r['roofline_ms']:.2f} ms" if "roofline_ms" in r else "-"
        ratio = f"{r['step_over_roofline']:.2f}" if "step_over_roofline" in r else "-"
        same = f"{r['identical_share']:.1%}" if r.get("identical_share") is not None else "-"
        lines.append(f"{r['model']:<14} {r['engine']:<17} {r['num_requests']:>8} {r['output_tok_per_s']:>10.1f} "
                     f"{step:>16} {roof:>9} {ratio:>6} {same:>9}")
    return "\n".join(lines)


def write_suite_json(report: dict[str, Any], path: Path) -> None:
    """Written whole or not at all (a file beside it, then renamed): a run killed while writing keeps the last."""
    slim = {**report, "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in report["rows"]]}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(slim, indent=2))
    os.replace(partial, path)

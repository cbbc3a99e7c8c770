"""One engine of a benchmark, in its own process: `python -m bulkgen.bench.child SPEC.json OUT.json`.

Loading is excluded from the timed span. The result holds each request's output token ids, its
finish time, and what the engine can tell about itself (preemptions, batch occupancy, steps).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bulkgen.bench.suite import NullTokenizer, build_model, decode_roofline, measure_device
from bulkgen.bench.workload import Workload
from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.engine.loading import TORCH_DTYPES
from bulkgen.engine.protocol import FinishReason
from bulkgen.model import ModelShape
from bulkgen.packing import admission_for, order
from bulkgen.store.packings import DEFAULT_PACKING


def _sampling(spec: dict[str, Any], i: int) -> dict[str, Any]:
    """The run's sampling settings (bench --temperature ...) for request i, seeded by its index as a
    submitted job's rows are; {} for greedy."""
    sampling = spec.get("sampling") or {}
    return {**sampling, "seed": i} if sampling.get("temperature") else {}


def run_bulkgen(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    config = EngineConfig(**spec["engine_config"])
    admission = admission_for(spec.get("packing", DEFAULT_PACKING), spec.get("kv_admission", True))
    if "suite_model" in spec:  # bench --suite: random weights from a config, the same in every engine's process
        model = _load_model(spec)
        engine = Engine(model, config, tokenizer=NullTokenizer(), admission=admission)
    else:
        engine = Engine(spec["model"], config, admission=admission)
    engine.stats.keep_steps = True
    items = order(list(range(len(workload.prompts))), spec.get("packing", DEFAULT_PACKING),
                  prompt_len=lambda i: len(workload.prompts[i]), max_new=lambda i: workload.max_new_tokens[i],
                  prompt_ids=lambda i: workload.prompts[i])
    _warm_up(engine)
    schema = json.dumps(spec["json_schema"]) if spec.get("json_schema") else None
    if schema is not None:
        engine.constraints.matcher(schema)  # compiled once before the clock starts, as submit does
    start = time.perf_counter()
    for i in items:
        engine.add(i, workload.prompts[i], SamplingParams(max_new_tokens=workload.max_new_tokens[i], ignore_eos=True,
                                                          json_schema=schema, **_sampling(spec, i)))
    outputs: dict[int, list[int]] = {}
    finish: dict[int, float] = {}
    complete: dict[int, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.output_token_ids
            finish[out.request_id] = time.perf_counter() - start
            if out.finish_reason == FinishReason.STOP:
                complete[out.request_id] = out.text
    wall = time.perf_counter() - start
    steps = engine.stats.steps
    return {
        "output_token_ids": [outputs[i] for i in range(len(workload.prompts))],
        "finish_s": [finish[i] for i in range(len(workload.prompts))],
        "wall_s": wall,
        "preemptions": engine.stats.num_preemptions,
        "prompt_tokens_computed": engine.stats.num_prompt_tokens_computed,
        "num_steps": engine.stats.num_steps,
        "drafted_tokens": engine.stats.num_draft_tokens,
        "accepted_tokens": engine.stats.num_accepted_tokens,
        "mean_batch_occupancy": sum(s.num_seqs for s in steps) / max(len(steps), 1),
        "padding_fraction": 0.0,
        "kv_cache_bytes": engine.runner.kv_cache_bytes,
        "kv_cache_tokens": engine.runner.max_num_tokens,
        "steps": [[round(s.time - steps[0].time, 4), s.num_batched_tokens, s.num_decode_tokens, s.num_seqs,
                   round(s.kv_usage, 4), s.num_context_tokens] for s in steps],
        "notes": engine.runner.paths.short() if engine.runner.device.type == "cpu" else "Triton attention",
        "cpu_paths": {name: path.use_c for name, path in engine.runner.paths.families.items()},
        "decode": _decode_roofline(spec, engine, steps),
        **({"json_valid": [sum(_valid_json(text, spec["json_schema"]) for text in complete.values()), len(complete)]}
           if schema is not None else {}),
    }


def _valid_json(text: str, schema: dict[str, Any]) -> bool:
    """Whether a complete output parses and validates against its schema (where jsonschema is installed: the
    test extra's; else whether it parses)."""
    try:
        value = json.loads(text)
        import jsonschema  # here: an optional package
    except json.JSONDecodeError:
        return False
    except ImportError:
        return True
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def _decode_roofline(spec: dict[str, Any], engine: Any, steps: list[Any]) -> dict[str, Any] | None:
    """For bench --suite: the decode step at the largest batch against its roofline on this device."""
    if "suite_model" not in spec or not steps:
        return None
    rows = [[s.time, s.num_batched_tokens, s.num_decode_tokens, s.num_seqs, s.kv_usage, s.num_context_tokens]
            for s in steps]
    return decode_roofline(rows, ModelShape.of(engine.runner.model.config), engine.config.dtype,
                           measure_device(engine.runner.device, engine.runner.dtype))


def _load_model(spec: dict[str, Any]) -> Any:
    """The benchmark's model on the device the engines use (a GPU if there is one): from its directory, or for
    bench --suite built from its config with seeded random weights."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = TORCH_DTYPES[spec["dtype"]]
    if "suite_model" in spec:
        model = build_model(spec["suite_model"], dtype, device)
        model.generation_config.pad_token_id = 0
        return model
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def run_bulkgen_store(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """The same requests end to end through the job store: queued in SQLite, run by a worker (claims,
    leases, heartbeats, commits), read back. The requests are written with the workload's own token
    ids, so the outputs compare with the engine's."""
    # here, not at the top: the other engines run where the database packages are not installed (a GPU's)
    from sqlalchemy import select

    from bulkgen.store import jobs as job_ops
    from bulkgen.store.db import open_store
    from bulkgen.store.models import Job, Request, Result, unpack_ids
    from bulkgen.worker import Worker, WorkerOptions

    model_path = str(Path(spec["model"]).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(f"sqlite:///{tmp}/bench.db")
        sampling = SamplingParams(ignore_eos=True, **{**_sampling(spec, 0), "seed": 0})
        with store.session_scope(write=True) as session:
            job_id = job_ops.new_job(session, name="bench", model=model_path, model_path=model_path,
                                     spec={"sampling": sampling.to_dict()})
            job_ops.insert_requests(session, [
                job_ops.request_row(job_id, i, 0, p, n, seed=i)
                for i, (p, n) in enumerate(zip(workload.prompts, workload.max_new_tokens, strict=True))])
            job_ops.open_job(session, job_id, len(workload.prompts))
        options = WorkerOptions(job_ids=(job_id,), progress=False, packing=spec.get("packing", DEFAULT_PACKING),
                                kv_admission=spec.get("kv_admission", True))
        worker = Worker(store, EngineConfig(**spec["engine_config"]), options)
        with store.session_scope() as session:
            job = session.get(Job, job_id)
        engine = worker._engine(job)  # loaded outside the timed span
        _warm_up(engine)
        start = time.perf_counter()
        summary = worker.run()
        wall = time.perf_counter() - start
        with store.session_scope() as session:
            rows = session.execute(select(Request.row, Result.token_ids).join(Result)
                                   .where(Request.job_id == job_id).order_by(Request.row)).all()
    return {
        "output_token_ids": [unpack_ids(r.token_ids) for r in rows],
        "finish_s": None,
        "wall_s": wall,
        "preemptions": summary.num_preemptions,
        "notes": "through the job store (SQLite) and a worker",
    }


def run_hf_static(spec: dict[str, Any], workload: Workload, sort: bool) -> dict[str, Any]:
    """Hugging Face generate() on left-padded static batches (file order, or sorted by prompt length)."""
    model = _load_model(spec)
    model.set_attn_implementation("sdpa")
    pad = model.generation_config.pad_token_id or model.config.eos_token_id or 0
    if isinstance(pad, list):
        pad = pad[0]
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i])) if sort \
        else list(range(len(workload.prompts)))
    best: dict[str, Any] | None = None
    for batch_size in spec.get("hf_batch_sizes", [8]):
        outputs: dict[int, list[int]] = {}
        finish: dict[int, float] = {}
        slots = useful = 0
        start = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(order), batch_size):
                batch = order[b:b + batch_size]
                longest = max(len(workload.prompts[i]) for i in batch)
                steps = max(workload.max_new_tokens[i] for i in batch)
                ids = torch.full((len(batch), longest), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), longest), dtype=torch.long)
                for row, i in enumerate(batch):
                    prompt = workload.prompts[i]
                    ids[row, longest - len(prompt):] = torch.tensor(prompt)
                    mask[row, longest - len(prompt):] = 1
                out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                     max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=pad)
                done = time.perf_counter() - start
                for row, i in enumerate(batch):
                    outputs[i] = out[row, longest:longest + workload.max_new_tokens[i]].tolist()
                    finish[i] = done
                    useful += len(workload.prompts[i]) + workload.max_new_tokens[i]
                slots += len(batch) * (longest + steps)
        wall = time.perf_counter() - start
        result = {"output_token_ids": [outputs[i] for i in range(len(workload.prompts))],
                  "finish_s": [finish[i] for i in range(len(workload.prompts))], "wall_s": wall,
                  "padding_fraction": 1 - useful / slots, "mean_batch_occupancy": float(batch_size),
                  "notes": f"batch size {batch_size}"}
        if best is None or wall < best["wall_s"]:
            best = result
    assert best is not None
    return best


def run_hf_cb(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """transformers' own continuous batching (generate_batch's manager), per-request budgets, EOS off."""
    from transformers import GenerationConfig

    model = _load_model(spec)
    model.set_attn_implementation("sdpa")
    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_new_tokens), eos_token_id=-1,
                              pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=_hf_cb_config(model, spec))
    manager.start()
    outputs: dict[int, list[int]] = {}
    finish: dict[int, float] = {}
    start = time.perf_counter()
    try:
        for i, prompt in enumerate(workload.prompts):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=workload.max_new_tokens[i],
                                eos_token_id=-1)
        while len(outputs) < len(workload.prompts):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching returned nothing for 10 minutes")
            if result.is_finished():
                outputs[int(result.request_id)] = list(result.generated_tokens)
                finish[int(result.request_id)] = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    wall = time.perf_counter() - start
    return {"output_token_ids": [outputs[i] for i in range(len(workload.prompts))],
            "finish_s": [finish[i] for i in range(len(workload.prompts))], "wall_s": wall}


def _hf_cb_config(model: Any, spec: dict[str, Any]) -> Any:
    """The KV budget bulkgen got (--kv-cache-memory), as transformers' blocks; None (transformers sizes its cache to
    the device's free memory) where none was given. On a CPU that default zeroes most of the machine's memory before
    the first step (tens of seconds on 24 GB)."""
    kv_bytes = spec.get("engine_config", {}).get("kv_cache_memory")
    if not kv_bytes:
        return None
    from transformers import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig()
    bytes_per_token = ModelShape.of(model.config).kv_bytes_per_token(spec["dtype"])
    cb.num_blocks = max(1, kv_bytes // (bytes_per_token * cb.page_size))
    cb.max_batch_tokens = spec["engine_config"].get("max_num_batched_tokens") or None
    return cb


def _warm_up(engine: Any) -> None:
    """One tiny request, so first-call costs (kernel build, allocator) stay out of the timed span."""
    list(engine.generate([[100, 101, 102, 103]], SamplingParams(max_new_tokens=2, ignore_eos=True)))
    engine.stats.steps.clear()
    engine.stats.num_preemptions = engine.scheduler.num_preemptions = engine.stats.num_prompt_tokens_computed = 0


RUNNERS = {
    "bulkgen": run_bulkgen,
    # the suite's second bulkgen entry: decode steps replayed as CUDA graphs (gpu/graphs.py)
    "bulkgen-graphs": lambda spec, w: run_bulkgen({**spec, "engine_config": {**spec["engine_config"],
                                                                             "cuda_graphs": True}}, w),
    "bulkgen-store": run_bulkgen_store,
    "hf-static": lambda spec, w: run_hf_static(spec, w, sort=False),
    "hf-static-sorted": lambda spec, w: run_hf_static(spec, w, sort=True),
    "hf-cb": run_hf_cb,
}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("num_threads"):
        torch.set_num_threads(spec["num_threads"])
    workload = Workload.load(Path(spec["workload"]))
    result = RUNNERS[spec["engine"]](spec, workload)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

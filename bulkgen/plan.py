# Whole (over 300 lines): the replay, the calibration that times it and the job's requests it reads are one
# prediction: kept together, what the replay counts and what the calibration measures stay the same features.
"""`bulkgen plan`: what a job will cost on this machine before it runs: wall time, output tokens, prompt tokens
computed after prefix reuse, peak KV blocks and mean batch, for the engine options given and for candidates of
--max-num-seqs, --kv-cache-memory and --packing.

bulkgen knows every request of a job before it starts (its prompt's token ids and its budget) and its scheduler
runs without a model, so the plan replays the real one: the packer's order and claims (`packing.order`,
`claim_target`), the KV admission, the block manager with its prefix cache, chunked prefill, step by step, each
step's time from a cost model of this machine and model (`StepCost`, below; fitted by least squares, no coefficient
below 0, on about 30 s of real steps over synthetic prompts; and the engine's load; cached per machine, model and
options in the user cache, like the kernel race).

A step's seconds = a + b * max(rows, knee) + c * sampled rows + d * query-key pairs. Rows are the tokens through the
linear layers: below `knee` rows a step streams its weights and the rows ride along (a CPU's decode step of 1 row and
of 8 cost the same), above it each row costs its FLOPs. Sampled rows pay the LM head and the sampler. Attention pays
per query-key pair (a decode row against its context, a prompt chunk's tokens against theirs: one coefficient, so
that a calibration too short for long prompts, a big model's, still measures it on decode contexts), its products
and its KV's bytes together: a term for the distinct tokens read (a shared prefix's blocks stay in the CPU's cache)
was tried and left out, as the calibration's few seconds cannot fill enough distinct KV to measure it. The knee is
the one whose fit leaves the least error. The calibration's batches are shaped like jobs (1 to 128 sequences,
contexts up to 1,024 tokens, 96 sequences over 4 shared documents), shortened for a model too slow for
CALIBRATION_S of them.

What the replay cannot know: where a request without --ignore-eos meets its EOS. Its budget is used (an upper
bound: the plan says "<="), scaled by the share of their budgets that the job's finished requests used where some
have finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update

from bulkgen.config import EngineConfig, Paths, SamplingParams, format_size
from bulkgen.engine.block_manager import BlockManager, KVLayout
from bulkgen.engine.scheduler import Scheduler
from bulkgen.engine.sequence import Sequence, SequenceStatus
from bulkgen.errors import InputError
from bulkgen.packing import admission_for, claim_target, order
from bulkgen.progress import format_duration
from bulkgen.store import jobs as job_ops
from bulkgen.store.models import Job, Request, RequestState, Result, iso_utc, unpack_ids, utcnow
from bulkgen.store.queue import QueueShape
from bulkgen.worker import runs_to_budget

COST_VERSION = 4  # bump when the calibration changes: cached costs of other versions are measured again
OUTPUT_TOKEN = 1 << 30  # output tokens of the replay: ids no prompt holds, so that they share no prefix
CALIBRATION_S = 30.0  # the seconds of timed steps the calibration aims at (a bigger model: shorter prompts)
KNEES = (0, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the rows below which a step costs its weights' stream, tried


@dataclass(frozen=True)
class StepFeatures:
    """What a step's time depends on, as the replay and the calibration count it."""

    decode: int  # decoding sequences' tokens
    prefill: int  # prompt tokens computed
    sampled: int  # rows sampled (the LM head, the sampler): the decoding sequences' and each prompt's last chunk's
    attended: int  # tokens of KV the step's attention reads, each sequence its own context
    prefill_attention: int  # each prompt chunk's tokens times its context (prefill attention is quadratic)

    @property
    def rows(self) -> int:
        """Tokens through the linear layers."""
        return self.decode + self.prefill

    def terms(self, knee: int) -> list[float]:
        # a query against a key costs the same products in a decode row and in a prompt chunk: one coefficient for
        # both (a calibration too short to see long prompts, a big model's, still sees decode contexts)
        return [1.0, float(max(self.rows, knee)), float(self.sampled), float(self.attended + self.prefill_attention)]


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step, and of loading the engine, on the machine it was measured on."""

    base: float
    per_row: float  # a token's row in the linear layers, above `knee` rows
    per_sampled: float  # a sampled row's LM head and sampling
    per_pair: float  # a query against a token of its context (a decode row's, a prompt chunk's): products, bytes
    knee: int  # below this many rows a step costs as much as at it (the weights' stream)
    load_s: float  # Engine() for this model and these options, its warm-up included
    num_blocks: int  # the KV blocks the engine had with these options
    block_bytes: int  # one block's bytes (to size candidates of --kv-cache-memory)
    layout_windows: tuple[int, ...] = (0,)  # per layer: its sliding window (0: full attention)
    num_layers: int = 1
    max_model_len: int = 2048

    def blocks_for(self, config: EngineConfig) -> int:
        """The KV blocks an engine with `config` would have (kv_cache.KVCache's rule, without allocating it)."""
        if config.kv_cache_memory is not None:
            return max(config.kv_cache_memory // self.block_bytes - 1, 1)
        groups = KVLayout.of(self.num_layers, self.layout_windows).num_groups
        per_seq = -(-self.max_model_len // config.block_size) * groups
        return min(self.num_blocks, config.max_num_seqs * per_seq + 4 * groups)

    def seconds(self, features: StepFeatures) -> float:
        coefficients = (self.base, self.per_row, self.per_sampled, self.per_pair)
        return sum(c * t for c, t in zip(coefficients, features.terms(self.knee), strict=True))


@dataclass(frozen=True)
class PlannedRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int  # what it is expected to generate (its budget, or the budget scaled by the EOS share)


@dataclass
class Prediction:
    seconds: float
    output_tokens: int
    prompt_tokens_computed: int
    peak_kv_blocks: int
    mean_batch: float
    steps: int
    max_num_seqs: int
    kv_cache_blocks: int
    packing: str
    upper_bound: bool  # some request may end at its EOS before its budget: the figures are at most these

    def to_dict(self) -> dict[str, Any]:
        return {key: round(value, 2) if isinstance(value, float) else value for key, value in asdict(self).items()}


def replay(requests: list[PlannedRequest], config: EngineConfig, cost: StepCost, num_blocks: int,
           packing: str, kv_admission: bool = True, upper_bound: bool = False) -> Prediction:
    """The job run through the real scheduler without a model: a worker's claims (in the packer's order, as many
    as `claim_target` says), the KV admission, the prefix cache; each step timed by `cost`."""
    layout = KVLayout.of(cost.num_layers, cost.layout_windows)
    bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, layout,
                      null_block=num_blocks if layout.slides else None)
    make = admission_for(packing, kv_admission)
    admission = make(num_blocks, config.block_size, layout.group_windows) if make else None
    scheduler = Scheduler(bm, config.max_num_seqs, config.max_num_batched_tokens, admission)
    queue = deque(order(list(range(len(requests))), packing,
                        prompt_len=lambda i: len(requests[i].prompt_token_ids),
                        max_new=lambda i: requests[i].max_new_tokens,
                        prompt_ids=lambda i: requests[i].prompt_token_ids))
    kv_tokens = num_blocks * config.block_size // max(layout.num_full_groups, 1)
    mean = sum(len(r.prompt_token_ids) + r.max_new_tokens for r in requests) / max(len(requests), 1)
    target = claim_target(config.max_num_seqs, kv_tokens, QueueShape(len(requests), 0, mean, 1))
    seconds, steps, batch, computed, peak, outputs = cost.load_s, 0, 0, 0, 0, 0
    while queue or scheduler.has_unfinished():
        while queue and len(scheduler.waiting) + len(scheduler.running) < target:
            i = queue.popleft()
            scheduler.add(Sequence(i, requests[i].prompt_token_ids,
                                   SamplingParams(max_new_tokens=max(requests[i].max_new_tokens, 1), ignore_eos=True)))
        out = scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("the replay's scheduler admitted nothing: a request larger than the KV cache")
        bm.take_copies()
        features = step_features(out)
        scheduler.update(out)
        steps += 1
        batch += len(out.scheduled)
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        computed += features.prefill
        seconds += cost.seconds(features)
        for s in out.scheduled:
            seq = s.seq
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt still in chunks: nothing sampled yet
            seq.append_token(OUTPUT_TOKEN + outputs)
            outputs += 1
            if seq.num_output_tokens >= seq.params.max_new_tokens:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
    return Prediction(seconds, outputs, computed, peak, batch / max(steps, 1), steps, config.max_num_seqs,
                      num_blocks, packing, upper_bound)


def calibrate(model_path: str | Path, config: EngineConfig, log: Any = None) -> StepCost:
    """The step cost of this machine for this model and these options: measured once (about 30 s of real
    steps over synthetic prompts of a few shapes, ~40 s in all for SmolLM2 on a Zen 3, ~2 min for a 1B model), then
    read from the user cache."""
    path = _cost_path(model_path, config)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            data["layout_windows"] = tuple(data["layout_windows"])
            return StepCost(**data)
        except (ValueError, TypeError, KeyError):
            pass  # a cache of another version: measured again
    if log:
        log(f"bulkgen plan: measuring this machine's step times for {Path(model_path).name} (once; cached in "
            f"{path.parent})")
    cost = _measure(model_path, replace(config, kv_cache_memory=None, max_num_seqs=EngineConfig().max_num_seqs))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(cost)))
    os.replace(tmp, path)
    return cost


def _cost_path(model_path: str | Path, config: EngineConfig) -> Path:
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    # candidates of these are replayed, not measured
    options = {k: v for k, v in asdict(config).items() if k not in ("max_num_seqs", "kv_cache_memory")}
    key = json.dumps([COST_VERSION, str(Path(model_path).resolve()), platform.machine(), os.cpu_count(),
                      os.environ.get("BULKGEN_KERNEL_CFLAGS", ""), cpu, repr(sorted(options.items()))])
    return Paths().cache_dir / "plan" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _measure(model_path: str | Path, config: EngineConfig) -> StepCost:
    from bulkgen.engine.engine import Engine  # here: the replay needs no torch

    engine = Engine(model_path, config)  # the first on a machine races and builds the kernels (then cached)
    engine.stats.keep_steps = True
    list(engine.generate([[100, 101, 102, 103]], SamplingParams(max_new_tokens=2, ignore_eos=True)))
    features: list[StepFeatures] = []  # of each step the scheduler made, as the replay counts them
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        if not out.is_empty:
            features.append(step_features(out))
        return out

    engine.scheduler.schedule = recording
    rng = random.Random(0)
    vocab, longest = engine.runner.shape.vocab, min(1024, engine.max_model_len - 16)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, max(vocab, 200)) for _ in range(min(n, longest))]

    # batches of 1 to 128 sequences (the knee), short and long prompts (prefill in chunks), many sequences at long
    # contexts (a job's decode steps), some sharing a prefix (a job's documents, each computed once): (sequences,
    # shared prompt tokens, own prompt tokens, new tokens); a model too big for CALIBRATION_S of them on this machine
    # gets shorter prompts and fewer new tokens (its attention matters less)
    most = config.max_num_seqs
    shapes = [(1, 0, 256, 24), (4, 0, 256, 16), (16, 0, 96, 16), (min(128, most), 0, 32, 16), (8, 0, longest, 12),
              (min(96, most), longest * 3 // 4, 64, 32), (min(48, most), 0, 256, 24)]
    prefixes = 4  # the shared batch's sequences share one of these (a job's documents: more than the CPU's cache holds)
    start = time.perf_counter()
    list(engine.generate([tokens(128)], SamplingParams(max_new_tokens=1, ignore_eos=True)))
    per_token = (time.perf_counter() - start) / 128  # a token through the model, roughly
    fixed = prefixes * sum(shared for _, shared, _, _ in shapes)
    work = sum(num * own + new * max(num, 16) for num, _, own, new in shapes)  # tokens through the model
    scale = min(1.0, CALIBRATION_S / per_token / (work + fixed))
    batches = []
    for num, shared, own, new in shapes:
        documents = [tokens(round(shared * scale ** 0.5)) for _ in range(prefixes if shared else 1)]  # once each
        batches.append(([documents[i % len(documents)] + tokens(max(4, round(own * scale))) for i in range(num)],
                        max(4, round(new * max(scale, 1 / 3)))))
    measured: list[tuple[StepFeatures, float]] = []
    for prompts, new in batches:
        engine.stats.steps.clear()
        features.clear()
        list(engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True)))
        steps = engine.stats.steps
        measured += [(features[k], steps[k].time - steps[k - 1].time) for k in range(1, len(steps))]
    engine.scheduler.schedule = schedule
    coefficients, knee = _fit(measured)
    load_s = _load_seconds(model_path, config)
    kv, shape = engine.runner.kv, engine.runner.shape
    return StepCost(*coefficients, knee, load_s, engine.block_manager.num_blocks,
                    kv.num_bytes // max(kv.tensor.shape[2], 1),
                    tuple(engine.runner.windows or (0,) * shape.num_layers), shape.num_layers, engine.max_model_len)


def _fit(measured: list[tuple[StepFeatures, float]]) -> tuple[list[float], int]:
    """The coefficients and the knee whose fit of these steps' times leaves the least squared error."""
    import numpy as np

    times = np.array([t for _, t in measured])
    best: tuple[float, list[float], int] | None = None
    for knee in KNEES:
        x = np.array([f.terms(knee) for f, _ in measured])
        coefficients = _nonnegative_fit(x, times)
        error = float(((x @ np.array(coefficients) - times) ** 2).sum())
        if best is None or error < best[0]:
            best = (error, coefficients, knee)
    return best[1], best[2]


LOAD_SCRIPT = """
import json, sys, time
start = time.perf_counter()
from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
engine = Engine(sys.argv[1], EngineConfig(**json.loads(sys.argv[2])))
list(engine.generate([[100, 101, 102, 103]], SamplingParams(max_new_tokens=2, ignore_eos=True)))
print(time.perf_counter() - start)
"""


def _load_seconds(model_path: str | Path, config: EngineConfig) -> float:
    """The engine's load as a run pays it, in a process of its own (imports, weights, kernels from the cache,
    zeroing the KV cache): in this one, what the calibration loaded is warm."""
    result = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(model_path), json.dumps(asdict(config))],
                            capture_output=True, text=True, check=False)
    try:
        return float(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"bulkgen plan: timing the engine's load failed: {result.stderr.strip()[-500:]}") from None


def step_features(out: Any) -> StepFeatures:
    """What a scheduler's step computes, counted before the step (the sequences' computed tokens do not yet hold
    this step's)."""
    decode = prefill = sampled = attended = prefill_attention = 0
    for s in out.scheduled:
        seq = s.seq
        computed = seq.num_computed_tokens
        attended += computed + s.num_new_tokens
        if seq.num_output_tokens > 0 and s.num_new_tokens - s.num_draft_tokens == 1:  # a draft's rows decode too
            decode += s.num_new_tokens
            sampled += s.num_new_tokens
        else:
            prefill += s.num_new_tokens
            prefill_attention += s.num_new_tokens * (computed + s.num_new_tokens // 2)
            sampled += computed + s.num_new_tokens >= seq.num_tokens
    return StepFeatures(decode, prefill, sampled, attended, prefill_attention)


def _nonnegative_fit(x: Any, y: Any) -> list[float]:
    """Least squares with every coefficient >= 0 (a cost cannot be negative): the negative ones dropped, refitted."""
    import numpy as np

    keep = list(range(x.shape[1]))
    while True:
        scale = np.abs(x[:, keep]).max(axis=0)  # the columns' units differ by 10^6: each solved in its own
        scale[scale == 0] = 1.0
        fit, *_ = np.linalg.lstsq(x[:, keep] / scale, y, rcond=None)
        fit = fit / scale
        if (fit >= 0).all() or len(keep) == 1:
            coefficients = [0.0] * x.shape[1]
            for i, value in zip(keep, fit, strict=True):
                coefficients[i] = max(float(value), 0.0)
            return coefficients
        keep = [i for i, value in zip(keep, fit, strict=True) if value >= 0] or keep[:1]


def job_requests(store: Any, job_id: int) -> tuple[Any, list[PlannedRequest], bool]:
    """A job's pending requests as the replay takes them, its row, and whether the figures are an upper bound:
    a request that may meet its EOS counts its budget, scaled by the share of their budgets that the job's
    finished requests used once some have (then an estimate, not a bound)."""
    with store.session_scope() as session:
        job = job_ops.get_job(session, job_id)
        rows = session.execute(select(Request.prompt_token_ids, Request.max_new_tokens)
                               .where(Request.job_id == job_id, Request.state == RequestState.PENDING.value)
                               .order_by(Request.id)).all()
        used, budget = session.execute(select(func.sum(Result.num_output_tokens), func.sum(Request.max_new_tokens))
                                       .join(Request, Request.id == Result.request_id)
                                       .where(Result.job_id == job_id)).one()
    exact = runs_to_budget(job.spec)
    share = 1.0 if exact or not budget else min(1.0, (used or 0) / budget)
    requests = [PlannedRequest(unpack_ids(r.prompt_token_ids), max(1, round(r.max_new_tokens * share))) for r in rows]
    return job, requests, not exact and not budget


def plan_job(store: Any, job_id: int, configs: list[tuple[EngineConfig, str]], kv_admission: bool = True,
             log: Any = None) -> tuple[StepCost, list[Prediction], int]:
    """Predictions for a job's pending requests, one for each (engine options, packing); the step cost they used;
    and how many requests were planned. InputError where nothing is pending."""
    job, requests, upper = job_requests(store, job_id)
    if not requests:
        raise InputError(f"job {job_id} has no pending requests to plan")
    cost = calibrate(job.model_path, configs[0][0], log=log)
    predictions = [replay(requests, config, cost, cost.blocks_for(config), packing, kv_admission, upper)
                   for config, packing in configs]
    config, packing = configs[0]
    with store.session_scope(write=True) as session:  # the report holds it against the run
        session.execute(update(Job).where(Job.id == job_id).values(plan={
            "predicted": predictions[0].to_dict(), "engine_load_s": round(cost.load_s, 2), "at": iso_utc(utcnow()),
            "num_requests": len(requests),
            "options": {"max_num_seqs": config.max_num_seqs,
                        "kv_cache_memory": format_size(config.kv_cache_memory) if config.kv_cache_memory else None,
                        "packing": packing, "dtype": config.dtype, "quantization": config.quantization}}))
    return cost, predictions, len(requests)


def describe(prediction: Prediction) -> str:
    """One line: the predicted time and what it does."""
    bound = "<= " if prediction.upper_bound else "about "
    return (f"{bound}{format_duration(prediction.seconds)}, {prediction.output_tokens:,} output tokens, "
            f"{prediction.prompt_tokens_computed:,} prompt tokens computed, mean batch {prediction.mean_batch:.1f}")

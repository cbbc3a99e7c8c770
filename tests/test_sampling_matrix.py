"""Sampling composes with everything else: every sampling option alone and combined, with and without JSON
schemas, on the C, torch and Triton-interpreter paths, with --quantization int8 and gguf, in memory and through
the queue, killed and resumed.

What each cell asserts: no row fails unless its input is bad; every complete constrained output parses and
validates (jsonschema); a sampled request gives the same tokens alone and in any batch (its seed decides).
The distribution itself is checked against transformers' warpers in test_sampler.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from tests.helpers import invoke, invoke_json, write_parquet
from tests.test_sampler import _run
from tests.tiny_gguf import make_tiny_gguf
from tests.zygote import run_bulkgen

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
SCHEMA_TEXT = json.dumps(SCHEMA)
SAMPLED = dict(temperature=0.8, top_p=0.95)
# every option, alone and combined (the first, greedy, is the control)
OPTIONS = {
    "greedy": {},
    "temperature": dict(temperature=1.0),
    "top-k": dict(temperature=0.9, top_k=20),
    "top-p": SAMPLED,
    "min-p": dict(temperature=1.2, min_p=0.05),
    "penalties": dict(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    "stops": dict(temperature=0.9, stop=("a", "e"), stop_token_ids=(11, 12)),
    "logprobs": dict(temperature=0.8, logprobs=2),
    "all": dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1, frequency_penalty=0.2,
                presence_penalty=0.1, stop=("zz",), logprobs=1),
}
PATHS = {"c": dict(kernels="c"), "c-int8": dict(kernels="c", quantization="int8"),
         "torch": dict(kernels="torch", attention_backend="torch"),
         "triton": dict(attention_backend="triton", block_size=16)}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 50))] for _ in range(n)]


def _check(out, params: SamplingParams) -> None:
    """No failure; a constrained output the grammar finished validates (a stop string or stop token may end
    one before its JSON closes: that is what the user asked)."""
    assert out.error is None and out.finish_reason != "error", (out.request_id, out.error)
    if out.finish_reason == "stop" and params.json_schema is not None:
        if params.stop or params.stop_token_ids:
            assert out.text == "" or out.text[0] == "{", out.text
        else:
            jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.fixture(scope="module", params=list(PATHS))
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Engine:
    if request.param == "triton":
        pytest.importorskip("triton")
    return Engine(tiny_model_dir, EngineConfig(kv_cache_memory=32 * 2**20, max_num_seqs=16, **PATHS[request.param]))


def test_every_option_with_and_without_a_schema_alone_and_batched(engine: Engine) -> None:
    """Each option, plain and JSON-constrained, in one batch of all of them; then each again alone: the
    same tokens (a sampled request's seed decides, not its neighbours)."""
    triton = engine.config.attention_backend == "triton"  # Triton's interpreter: a few cells, short
    names = ["greedy", "top-p", "all", "stops"] if triton else list(OPTIONS)
    prompts = _prompts(len(OPTIONS))
    requests = {}
    for i, (name, options) in enumerate(OPTIONS.items()):
        if name not in names:
            continue
        for constrained in (False, True):
            params = SamplingParams(max_new_tokens=12 if triton else 40, seed=100 + i,
                                    json_schema=SCHEMA_TEXT if constrained else None, **options)
            requests[f"{name}-{'json' if constrained else 'plain'}"] = (prompts[i], params)
    batched = _run(engine, requests)
    assert set(batched) == set(requests)
    for out in batched.values():
        _check(out, requests[out.request_id][1])
        if out.request_id.startswith("logprobs") or out.request_id.startswith("all"):
            assert len(out.logprobs) == len(out.output_token_ids)
    checked = [r for r in ("top-p-json", "all-json", "penalties-plain", "stops-plain", "temperature-json",
                           "top-k-plain", "min-p-plain", "logprobs-plain") if r in requests][:2 if triton else 8]
    differ = [r for r in checked if _run(engine, {r: requests[r]})[r].output_token_ids
              != batched[r].output_token_ids]
    # The C kernels compute a row the same in any batch (int8's too: activations quantized per row): identical.
    # torch's GEMMs round by batch shape (a few ulps of the logits), which flips a draw only on a near-tie, as it
    # flips a greedy near-tie: at most one.
    assert len(differ) <= (0 if engine.config.kernels == "c" else 1), differ
    constrained = [o for o in batched.values() if o.request_id.endswith("json") and o.finish_reason == "stop"
                   and not requests[o.request_id][1].stop]
    if not triton:  # (12 tokens are too few for the JSON to close)
        assert len(constrained) >= 4, [(o.request_id, o.finish_reason, o.text) for o in batched.values()]


def test_a_schema_the_budget_cannot_finish_ends_by_length_not_error(engine: Engine) -> None:
    schema = json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 1000})
    out = _run(engine, {"json": (_prompts(1)[0], SamplingParams(max_new_tokens=12, json_schema=schema, seed=1,
                                                                 **SAMPLED))})["json"]
    assert out.finish_reason == "length" and out.error is None and out.text.startswith("[")


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_sampled_json_schema_job_completes_every_row_through_the_queue(tmp_path: Path, db_url: str,
                                                                         tiny_model_dir: Path) -> None:
    """The headline case: --chat --json-schema --temperature 0.8 used to fail every row ('non-finite
    logits'); and per-row schemas beside unconstrained rows, sampled."""
    schema_file = tmp_path / "animal.json"
    schema_file.write_text(SCHEMA_TEXT)
    prompts = ["Describe an animal.", "A cat?", "Give me a dog.", "Name a bird.", "Tell me about fish.", "A cow."]
    data = write_parquet(tmp_path / "animals.parquet", {"prompt": prompts,
                                                        "schema": [SCHEMA_TEXT, None] * 3})
    job = invoke_json("submit", data, "--model", tiny_model_dir, "--chat", "--json-schema", schema_file,
                      "--temperature", 0.8, "--top-p", 0.95, "--max-new-tokens", 60, "--n", 2)
    mixed = invoke_json("submit", data, "--model", tiny_model_dir, "--json-schema-column", "schema",
                        "--temperature", 1.0, "--max-new-tokens", 60)
    invoke("run", "--kv-cache-memory", "16MiB", "--no-progress")
    for job_id, constrained in ((job["job_id"], [True] * 6), (mixed["job_id"], [True, False] * 3)):
        invoke("export", job_id, "-o", tmp_path / f"{job_id}.parquet")
        rows = pq.read_table(tmp_path / f"{job_id}.parquet").to_pylist()
        assert all(r["status"] == "completed" for r in rows), [(r["row"], r["error"]) for r in rows]
        complete = [r for r in rows if constrained[r["row"]] and r["finish_reason"] == "stop"]
        assert len(complete) >= 3, [(r["finish_reason"], r["output"]) for r in rows]
        for r in complete:
            jsonschema.validate(json.loads(r["output"]), SCHEMA)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_gguf_file_runs_from_its_blocks_through_the_queue_sampled_and_constrained(tmp_path: Path,
                                                                                    db_url: str) -> None:
    """--quantization gguf through submit and run: a Q4_K / Q6_K file (byte-level tokenizer), per-row schemas
    beside unconstrained rows, sampled; every row completes and every closed JSON validates."""
    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", None, width=256, ffn=512, kinds={"*": "Q4_K", "ffn_down": "Q6_K"})
    prompts = ["Describe an animal.", "A cat?", "Give me a dog.", "Name a bird.", "Tell me about fish.", "A cow."]
    data = write_parquet(tmp_path / "animals.parquet", {"prompt": prompts * 2, "schema": [SCHEMA_TEXT, None] * 6})
    job = invoke_json("submit", data, "--model", gguf, "--json-schema-column", "schema", "--temperature", 0.7,
                      "--max-new-tokens", 150)
    run = invoke("run", "--quantization", "gguf", "--kv-cache-memory", "16MiB")  # its first line names the blocks
    assert "GGUF blocks (Q4_K + Q6_K)" in run.output, run.output
    invoke("export", job["job_id"], "-o", tmp_path / "out.parquet")
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert all(r["status"] == "completed" for r in rows), [(r["row"], r["error"]) for r in rows]
    complete = [r for r in rows if r["row"] % 2 == 0 and r["finish_reason"] == "stop"]
    assert complete, [(r["finish_reason"], r["output"]) for r in rows]
    for r in complete:
        jsonschema.validate(json.loads(r["output"]), SCHEMA)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_an_openai_line_with_response_format_and_default_temperature_completes(tmp_path: Path, db_url: str,
                                                                               tiny_model_dir: Path) -> None:
    """No temperature in the line: OpenAI's default 1, sampled, constrained."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": f"JSON {i}"}],
                       "max_tokens": 60, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "a", "schema": SCHEMA}}}}
             for i in range(4)]
    lines.append({**lines[0], "custom_id": "object",
                  "body": {**lines[0]["body"], "response_format": {"type": "json_object"}}})
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = invoke_json("submit", path)
    invoke("run", job["job_id"], "--kv-cache-memory", "16MiB", "--no-progress")
    invoke("export", job["job_id"], "--format", "openai", "-o", tmp_path / "out.jsonl")
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all(x["error"] is None for x in out), [x["error"] for x in out]
    for x in out:
        choice = x["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            content = json.loads(choice["message"]["content"])
            if x["custom_id"] != "object":
                jsonschema.validate(content, SCHEMA)
            assert isinstance(content, dict)


def test_in_memory_generate_samples_with_a_schema(tiny_model_dir: Path) -> None:
    import bulkgen

    prompts = ["one", "two", "three", "four"]
    first = bulkgen.generate(prompts, model=str(tiny_model_dir), max_new_tokens=50, json_schema=SCHEMA_TEXT,
                             engine={"kv_cache_memory": 16 * 2**20}, **SAMPLED)
    again = bulkgen.generate(prompts[::-1], model=str(tiny_model_dir), max_new_tokens=50, json_schema=SCHEMA_TEXT,
                             engine={"kv_cache_memory": 16 * 2**20}, **SAMPLED)
    assert [r["output"] for r in first] == [r["output"] for r in again[::-1]]  # seeds follow the row, not its place
    assert all(r["error"] is None for r in first)
    for r in first:
        if r["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r["output"]), SCHEMA)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_sampled_constrained_job_killed_and_resumed_equals_an_uninterrupted_run(tmp_path: Path, make_db,
                                                                                   tiny_model_dir: Path,
                                                                                   quantization: str) -> None:
    from tests.test_worker_process import RUN_FLAGS, kill_before, start_worker

    NUM_ROWS = 120  # noqa: N806

    def make(db: str, folder: Path) -> int:
        folder.mkdir()
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(["cat", "dog", "owl", "fox"]) for _ in range(rng.randint(2, 30)))
                   for _ in range(NUM_ROWS)]
        schemas = [SCHEMA_TEXT, None] * (NUM_ROWS // 2)
        data = write_parquet(folder / "in.parquet", {"prompt": prompts, "schema": schemas})
        return invoke_json("submit", data, "--model", tiny_model_dir, "--json-schema-column", "schema",
                           "--temperature", 0.8, "--top-p", 0.95, "--max-new-tokens", 16, "--db", db)["job_id"]

    def export(db: str, job_id: int, path: Path) -> list[dict]:
        invoke("export", job_id, "-o", path, "--db", db)
        return pq.read_table(path).to_pylist()

    flags = ["--max-attempts", "10", "--max-num-seqs", "8", "--quantization", quantization]
    reference_db = make_db("reference")
    reference_job = make(reference_db, tmp_path / "ref")
    # the reference decodes without drafts; the killed and resumed runs draft (--speculate auto, the default)
    done = run_bulkgen(["run", "--db", reference_db, *RUN_FLAGS, *flags, "--speculate", "off"])
    assert done.returncode == 0, done.stderr
    reference = export(reference_db, reference_job, tmp_path / "reference.parquet")

    db = make_db("crash")
    job_id = make(db, tmp_path / "crash")
    rng = random.Random(7)
    committed = 0
    for _ in range(2):
        committed = kill_before(db, start_worker(db, *flags), min(committed + 20, NUM_ROWS - 40), rng)
    assert 0 < committed < NUM_ROWS - 20
    done = run_bulkgen(["run", "--db", db, *RUN_FLAGS, *flags, "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["accepted_tokens"] > 0, done.stdout  # drafts were kept
    rows = export(db, job_id, tmp_path / "resumed.parquet")
    assert [r["row"] for r in rows] == list(range(NUM_ROWS)) and all(r["status"] == "completed" for r in rows)
    assert [r["output"] for r in rows] == [r["output"] for r in reference]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_the_default_model_samples_valid_json_with_temperature(tmp_path: Path, db_url: str,
                                                               default_model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 20},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 1000}},
              "required": ["animal", "legs"], "additionalProperties": False}
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["Describe a cat as JSON.", "A spider, as JSON.",
                                                              "Give me a bird in JSON.", "A snake?"]})
    job = invoke_json("submit", data, "--model", default_model_dir, "--chat", "--json-schema", json.dumps(schema),
                      "--temperature", 0.8, "--top-p", 0.95, "--max-new-tokens", 48)
    invoke("run", job["job_id"], "--no-progress")
    invoke("export", job["job_id"], "-o", tmp_path / "out.parquet")
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert all(r["status"] == "completed" for r in rows), [r["error"] for r in rows]
    complete = [r for r in rows if r["finish_reason"] == "stop"]
    assert len(complete) >= 3, [r["output"] for r in rows]
    for r in complete:
        jsonschema.validate(json.loads(r["output"]), schema)

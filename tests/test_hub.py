"""Models by their hub names, fetched by the real huggingface_hub client from the suite's own hub (hubserver.py):
the commit pinned at submit and run by a worker elsewhere, resumed downloads, only the run's files, GGUF files
picked by their quantization, the cache offline, and each refusal a one-line error with nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import select

from bulkgen.errors import ModelError
from bulkgen.hub import fetch, parse_hub_name, pinned_model, with_gguf_file
from bulkgen.resolve import DEFAULT_MODEL, resolve_model
from bulkgen.store.db import open_store
from bulkgen.store.models import Job, Request, Result, unpack_ids
from tests.conftest import make_tiny_model
from tests.helpers import hf_greedy, invoke, invoke_json, write_parquet
from tests.hubserver import TOKEN, Hub, Repo, directory_files
from tests.tiny_gguf import make_tiny_gguf

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> list[Path]:
    """Two tiny models (two commits of one repository: the branch moves between submit and run)."""
    return [make_tiny_model(tmp_path_factory.mktemp(f"hub-tiny-{seed}"), default_model_dir, seed=seed)
            for seed in (0, 1)]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The suite's hub, online: HF_ENDPOINT at it, an empty cache, HF_HUB_OFFLINE off (the suite sets it on;
    huggingface_hub read it at import, so its constant is set too)."""
    from huggingface_hub import constants

    server = Hub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login` of this machine
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield server
    server.stop()


def _repo(model_dir: Path, **extra: bytes) -> dict[str, bytes]:
    return {**directory_files(model_dir), **extra}


def test_hub_name_pins_its_commit_and_a_worker_elsewhere_runs_it(hub: Hub, tiny_dirs: list[Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Submit fetches only the run's files (a dropped download resumes), the job keeps the commit; the branch
    moves; a worker with another cache (another node) fetches that commit, not the branch, and its greedy
    outputs are Hugging Face generate()'s on the first commit's weights."""
    repo = Repo()
    first = repo.push(_repo(tiny_dirs[0], **{"pytorch_model.bin": b"\0" * 64, "onnx/model.onnx": b"\0" * 64}))
    hub.repos["org/tiny"] = repo
    hub.drop_once.add("model.safetensors")
    data = write_parquet(tmp_path / "data.parquet", {"prompt": PROMPTS})
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    report = invoke_json("submit", data, "--model", "org/tiny", "--max-new-tokens", 6, "--ignore-eos", "--db", db)
    status = invoke_json("status", report["job_id"], "--db", db)
    assert status["model"] == "org/tiny" and status["model_revision"] == first
    fetched = hub.downloads()
    assert not any(path.endswith((".bin", ".onnx")) for path in fetched), fetched
    assert any(method == "GET" and rng for method, _, rng in hub.requests), "the cut download was not resumed"
    assert "(commit " + first[:12] in invoke("status", report["job_id"], "--db", db).output

    repo.push(_repo(tiny_dirs[1]))  # main moves on
    shutil.rmtree(tmp_path / "hf-cache")  # the worker's node has its own cache
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other-node-cache"))
    invoke("run", report["job_id"], "--db", db, "--no-progress")
    snapshots = tmp_path / "other-node-cache" / "models--org--tiny" / "snapshots"
    assert [p.name for p in snapshots.iterdir()] == [first]

    with open_store(db).session_scope() as session:
        rows = session.execute(select(Request.prompt_token_ids, Result.token_ids)
                               .join(Result, Result.request_id == Request.id).order_by(Request.row)).all()
    want = hf_greedy(tiny_dirs[0], [(unpack_ids(prompt), 6) for prompt, _ in rows], exact_length=True)
    got = [unpack_ids(ids) for _, ids in rows]
    assert len(got) == len(PROMPTS)
    assert got == want


def test_offline_runs_from_the_cache(hub: Hub, tiny_dirs: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    repo = Repo()
    first = repo.push(_repo(tiny_dirs[0]))
    repo.refs["v1"] = first
    hub.repos["org/tiny"] = repo
    online = resolve_model("org/tiny@v1", log=lambda _: None)
    assert online.revision == first
    # what Ray Data's generate() hands its actors: the name at its commit (every node runs the same weights)
    assert pinned_model("org/tiny@v1") == f"org/tiny@{first}" and pinned_model(DEFAULT_MODEL) == DEFAULT_MODEL
    hub.stop()  # the network is gone
    cached = resolve_model("org/tiny@v1", log=lambda _: None)  # the hub does not answer: the cache does
    assert (cached.path, cached.revision) == (online.path, first)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(f"org/tiny@{first}", log=lambda _: None).path == online.path
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set, and org/tiny@v2 is not in the hub cache"):
        resolve_model("org/tiny@v2", log=lambda _: None)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    # a byte-level tokenizer of 257 tokens: SmolLM2's 49,152 took the gguf package ~5 s a read, four reads here
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf", None).read_bytes()


def test_gguf_repository_by_quantization(hub: Hub, tiny_gguf: bytes) -> None:
    """ORG/NAME:QUANT (any case) and --gguf-file fetch that one file of the repository, byte for byte; it runs
    through the Python API and bench, its greedy outputs those of transformers' own GGUF loading + generate()."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bulkgen.api import generate

    hub.repos["org/tiny-GGUF"] = Repo()
    commit = hub.repos["org/tiny-GGUF"].push({"tiny-Q8_0.gguf": tiny_gguf, "tiny-Q4_K_M.gguf": b"not this one",
                                              "README.md": b"# GGUF files"})
    got = fetch(parse_hub_name("org/tiny-GGUF:q8_0"), log=lambda _: None)
    assert got.gguf and got.commit == commit and got.path.read_bytes() == tiny_gguf
    assert len(hub.downloads()) == 1, "only the file asked for"
    named = with_gguf_file("org/tiny-GGUF", "tiny-Q8_0.gguf")
    assert fetch(parse_hub_name(named), log=lambda _: None).path == got.path
    assert len(hub.downloads()) == 1, "the second time from the cache"

    results = generate(PROMPTS, model="org/tiny-GGUF:Q8_0", max_new_tokens=6, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(got.path.parent, gguf_file=got.path.name)
    model = AutoModelForCausalLM.from_pretrained(got.path.parent, gguf_file=got.path.name, dtype=torch.float32)
    want = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False)
        want.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert [r["output"] for r in results] == want
    assert "model org/tiny-GGUF:Q8_0" in invoke("bench", "--synthetic", 2, "--model", "org/tiny-GGUF:Q8_0",
                                                 "--compare", "", "--max-new-tokens", 4).stdout


def _error(*args: object) -> str:
    result = invoke(*args, expect=2)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_refusals_are_one_line_and_write_nothing(hub: Hub, tiny_dirs: list[Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = directory_files(tiny_dirs[0])
    hub.repos["org/gated"] = Repo(gated=True)
    hub.repos["org/gated"].push(model)
    hub.repos["org/bin-only"] = Repo()
    hub.repos["org/bin-only"].push({"config.json": model["config.json"], "pytorch_model.bin": b"\0" * 64})
    hub.repos["org/huge"] = Repo(sizes={"model.safetensors": 10**15})
    hub.repos["org/huge"].push(model)
    hub.repos["org/x-GGUF"] = Repo()
    hub.repos["org/x-GGUF"].push({"x-Q4_K_M.gguf": b"a", "x-Q8_0.gguf": b"b"})
    data = write_parquet(tmp_path / "data.parquet", {"prompt": PROMPTS})
    db = f"sqlite:///{tmp_path / 'jobs.db'}"

    def submit(model: str, *more: object) -> str:
        return _error("submit", data, "--model", model, *more, "--db", db)

    assert "no model 'org/missing' on the hub" in submit("org/missing")
    assert "`hf auth login`" in submit("org/missing")
    line = submit("org/gated")
    assert "org/gated is gated" in line and "HF_TOKEN" in line
    assert "has no revision 'nope'" in submit("org/bin-only@nope")
    assert "holds no safetensors or GGUF weights (it has pytorch_model.bin)" in submit("org/bin-only")
    assert "needs 1000000.00 GB" in submit("org/huge") and hub.downloads() == []
    assert "has no GGUF file 'Q5_K_S'; it has GGUF files: x-Q4_K_M.gguf, x-Q8_0.gguf" in submit("org/x-GGUF:Q5_K_S")
    assert "--gguf-file picks a file of a hub repository" in submit("smollm2-135m-instruct", "--gguf-file", "a.gguf")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert "did not answer" in submit("org/tiny") and "HF_HUB_OFFLINE=1" in submit("org/tiny")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE is set, and org/tiny is not in the hub cache" in submit("org/tiny")
    with open_store(db).session_scope() as session:
        assert session.scalars(select(Job)).all() == []

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # with a token that has access, the gated model resolves
    assert resolve_model("org/gated", log=lambda _: None).revision == hub.repos["org/gated"].refs["main"]

"""Shared fixtures: a fresh database per test, the real default model, and tiny random models."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is unreachable here; never wait for it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on the CPU, through triton's interpreter
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two xdist workers on two cores: one thread each, for torch, the C kernels and the `bulkgen` processes they
    # start (OpenMP threads spin while they wait: two processes of two threads each doubled the suite's CPU time)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ.get("BULKGEN_TEST_FAST_INTERPRETER", "1") != "0":  # its per-call set-up once (tests/triton_interpreter)
    from tests import triton_interpreter

    triton_interpreter.install()

REPO = Path(__file__).resolve().parents[1]


POSTGRES = os.environ.get("BULKGEN_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _postgres_reachable() -> str | None:
    """Why PostgreSQL tests cannot run here, or None (they run: CI's machines have the server)."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install bulkgen[postgres])"
    try:
        psycopg.connect(POSTGRES.replace("+psycopg", ""), connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"no PostgreSQL server at {POSTGRES}: {str(exc).splitlines()[0]}"
    return None


@pytest.fixture(scope="session")
def postgres_skip_reason() -> str | None:
    return _postgres_reachable()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, postgres_skip_reason: str | None) -> str:
    """Every test of the store, queue, submit, worker and export runs on both databases."""
    if request.param == "postgresql" and postgres_skip_reason:
        pytest.skip(postgres_skip_reason)
    return request.param


@pytest.fixture
def make_db(backend: str, tmp_path: Path):
    """make_db(name) -> the URL of a new, empty database of this test's backend: a SQLite file, or a fresh
    PostgreSQL schema (its own search_path), dropped after the test."""
    from sqlalchemy import create_engine, text

    schemas: list[str] = []

    def make(name: str = "bulkgen") -> str:
        if backend == "sqlite":
            return f"sqlite:///{tmp_path / f'{name}.db'}"
        import uuid

        schema = f"t_{name}_{uuid.uuid4().hex[:10]}".lower()
        with create_engine(POSTGRES).begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        schemas.append(schema)
        return f"{POSTGRES}?options=-csearch_path%3D{schema}"

    yield make
    if schemas:
        engine = create_engine(POSTGRES)
        with engine.begin() as conn:
            for schema in schemas:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


@pytest.fixture
def db_url(make_db, monkeypatch: pytest.MonkeyPatch) -> str:
    url = make_db("bulkgen")
    monkeypatch.setenv("BULKGEN_DB", url)
    return url


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, resolved (and converted once) through the user cache."""
    from bulkgen.resolve import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL).path


def make_tiny_model(out: Path, tokenizer_dir: Path, family: str = "llama", max_positions: int = 2048,
                    seed: int = 0, head_dim: int | None = None) -> Path:
    """A randomly initialised model of the given family with the real SmolLM2 tokenizer.

    Weights are drawn wider than usual (initializer_range 0.2) so next-token distributions are
    peaked: near-ties between the top two logits would make token-for-token comparisons flaky."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, initializer_range=0.2)
    if head_dim is not None:
        common["head_dim"] = head_dim
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_llama64_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Llama with head_dim 64, the CPU kernel's vectorised path (the others take its plain loop)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama64"), default_model_dir, head_dim=64, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), default_model_dir, family="qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_short_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny model with a 64-token context, to make prompts too long cheaply."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-short"), default_model_dir, max_positions=64)


PG_BIN = Path("/usr/lib/postgresql/15/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnPostgres:
    """A PostgreSQL server of the test's own, to restart and stop at will (as user postgres where we are root:
    the server refuses to run as root)."""

    def __init__(self, root: Path) -> None:
        self.data = root / "data"
        self.port = _free_port()
        self.log = root / "server.log"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        root.mkdir(parents=True, exist_ok=True)
        if self.as_user:
            shutil.chown(root, "postgres")
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "--no-sync")
        self.start()
        self.createdb("bulkgen")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/bulkgen"

    def createdb(self, name: str) -> None:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(PG_BIN / tool), *args], capture_output=True, text=True,
                              timeout=120, cwd="/")
        assert done.returncode == 0, f"{tool}: {done.stdout}{done.stderr}"

    def _ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", *args)

    def start(self) -> None:
        self._ctl("-o", f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")

    def restart(self) -> None:
        self._ctl("-m", "fast", "-o", f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1 -c fsync=off",
                  "restart")

    def is_running(self) -> bool:
        done = subprocess.run([*self.as_user, str(PG_BIN / "pg_ctl"), "-D", str(self.data), "status"],
                              capture_output=True, text=True, timeout=60, cwd="/")
        return done.returncode == 0


@pytest.fixture(scope="session")
def own_postgres_server():
    """One PostgreSQL server of the suite's own for the session (initdb once); each test gets a database of its own
    on it (own_postgres)."""
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL server binaries at {PG_BIN} (the CI machine has PostgreSQL 15)")
    pytest.importorskip("psycopg")
    root = Path(tempfile.mkdtemp(prefix="bulkgen-own-pg-", dir="/tmp"))  # not under pytest's 0700 tree: the server
    root.chmod(0o755)  # runs as another user
    try:
        server = OwnPostgres(root)
        try:
            yield server
        finally:
            try:
                server.stop()
            except AssertionError:
                pass
    finally:
        shutil.rmtree(root, ignore_errors=True)


class OwnDatabase:
    """A database of the test's own on the session's own server, which the test may restart and stop at will (the
    fixture starts it again if a test left it stopped)."""

    def __init__(self, server: OwnPostgres, name: str) -> None:
        self.server, self.name = server, name
        self.port = server.port
        server.createdb(name)
        self.url = server.url.rsplit("/", 1)[0] + f"/{name}"

    def createdb(self, name: str) -> None:
        self.server.createdb(name)

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server.restart()


@pytest.fixture
def own_postgres(own_postgres_server: OwnPostgres, request: pytest.FixtureRequest):
    import uuid

    database = OwnDatabase(own_postgres_server, f"t_{uuid.uuid4().hex[:12]}")
    yield database
    if not own_postgres_server.is_running():
        own_postgres_server.start()


@pytest.fixture(scope="session")
def standard_reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[dict]:
    """The export of test_worker_process.make_job's standard job run by one worker from start to end, without a
    fault: what every interrupted run of that job must equal (made once a session)."""
    from tests.test_worker_process import uninterrupted_run

    root = tmp_path_factory.mktemp("reference")
    return uninterrupted_run(root, tiny_model_dir, f"sqlite:///{root / 'reference.db'}")


# The files that take longest go first, each worker taking a file at a time (--dist loadfile), so that the short
# ones fill in beside the long ones at the end. Measured (the tests' seconds a file, `--durations=0`, AMD Zen 5,
# 2026-12-08: 1,457 s in all); pyproject's --no-loadscope-reorder keeps this order: xdist 3.5-3.7 always sorted
# the files by their number of tests, which put Ray's few long tests last.
LONGEST_FIRST = ("test_engine_hf.py", "test_ray.py", "test_sampling_matrix.py", "test_model_families.py",
                 "test_report.py", "test_worker_process.py", "test_bench.py", "test_gpu_check.py", "test_db_outage.py",
                 "test_soak.py", "test_hub.py", "test_sampler.py", "test_worker.py", "test_submit_memory.py",
                 "test_submit.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order

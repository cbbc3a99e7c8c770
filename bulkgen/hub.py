"""Models by their hub names: `ORG/NAME`, `ORG/NAME@REVISION` (a branch, tag or commit), `ORG/NAME:QUANT` or
`ORG/NAME:FILE.gguf` (one GGUF file of the repository, as llama.cpp's `-hf` spells it).

huggingface_hub does the fetching: its cache (HF_HOME, HF_HUB_CACHE), HF_TOKEN and `hf auth login`, HF_ENDPOINT
mirrors, HF_HUB_OFFLINE, resumed downloads and its file locks between processes. This module decides what to
fetch (only what a run reads: config, tokenizer, safetensors and their index, or one GGUF file), pins the branch
to its commit (the job stores it, so a worker tomorrow or on another node runs the same weights), checks the
disk before the download starts, and turns every failure into one line that says what to do.

Kept whole (over 300 lines): it is one noun, the conversation with the hub. Parsing a name, choosing the files,
the download and the cache fallback share the same repository metadata and the same error translation (each
huggingface_hub exception to its one line); split, every part would import the other's private helpers.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from bulkgen.errors import ModelError

Log = Callable[[str], None]

# ORG/NAME, then @REVISION (no ':' in it), then :QUANT or :FILE.gguf. A path that exists on disk wins (resolve.py).
HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^:@\s]+))?"
                      r"(?::(?P<gguf>[^:@\s]+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")
# What a run reads from a safetensors repository (top level only: other folders hold other formats).
RUN_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
             "tokenizer.model", "*.tiktoken", "chat_template.jinja", "chat_template.json")
INDEX = "model.safetensors.index.json"
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's choice where a GGUF repository is named without one
DISK_MARGIN_BYTES = 256 << 20
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


@dataclass(frozen=True)
class HubName:
    repo_id: str
    revision: str | None  # as written; None: the default branch
    gguf: str | None  # a quantization (Q4_K_M) or a file of the repository (…​.gguf); None: safetensors

    def pinned(self, commit: str) -> str:
        """The same name at one commit: what a worker elsewhere resolves to run the same weights."""
        return f"{self.repo_id}@{commit}" + (f":{self.gguf}" if self.gguf else "")


@dataclass(frozen=True)
class HubModel:
    path: Path  # the snapshot directory (safetensors) or the GGUF file in it
    commit: str
    gguf: bool


def parse_hub_name(spec: str) -> HubName | None:
    match = HUB_NAME.fullmatch(spec)
    if match is None:
        return None
    return HubName(match["repo"], match["revision"], match["gguf"])


def with_gguf_file(model: str, gguf_file: str | None) -> str:
    """`--gguf-file FILE` folded into the model's name (ORG/NAME:FILE), so that the job records one string."""
    if not gguf_file:
        return model
    name = parse_hub_name(model)
    if name is None or name.gguf:
        raise ModelError(f"--gguf-file picks a file of a hub repository: give --model ORG/NAME with it, "
                         f"not {model!r}")
    if not gguf_file.endswith(".gguf"):
        raise ModelError(f"--gguf-file {gguf_file!r} is not a .gguf file name")
    return f"{model}:{gguf_file}"


@dataclass(frozen=True)
class _Hub:
    """huggingface_hub's settings, read now (its own constants are read once, at its import)."""

    endpoint: str
    cache: Path
    offline: bool

    @classmethod
    def from_env(cls) -> _Hub:
        from huggingface_hub import constants

        env = os.environ
        if env.get("HF_HUB_CACHE"):
            cache = Path(env["HF_HUB_CACHE"])
        elif env.get("HF_HOME"):
            cache = Path(env["HF_HOME"]) / "hub"
        else:
            cache = Path(constants.HF_HUB_CACHE)
        offline_env = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE")
        offline = (offline_env or "").strip().lower() in ("1", "true", "yes", "on") if offline_env is not None \
            else constants.HF_HUB_OFFLINE
        return cls((env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"), cache.expanduser(), offline)


def fetch(name: HubName, log: Log) -> HubModel:
    """The files a run needs of `name`, from the cache or downloaded into it; ModelError (one line) if not."""
    hub = _Hub.from_env()
    if hub.offline:
        return _from_cache(name, hub, "HF_HUB_OFFLINE is set")
    commit, listing = _list(name, hub)
    if commit is None:  # the hub did not answer: the cache may hold it
        got = _from_cache(name, hub, str(listing))
        log(f"bulkgen: {listing}; {name.repo_id} runs from the hub cache, at commit {got.commit[:12]}")
        return got
    files = _choose(name, listing)
    _download(name, hub, commit, files, listing, log)
    return _located(name, hub, commit, files)


def pin(name: HubName) -> str | None:
    """The commit `name` stands for now (metadata only, no download), or None where the hub is not reachable."""
    hub = _Hub.from_env()
    if name.revision and COMMIT.fullmatch(name.revision):
        return name.revision
    if hub.offline:
        return _cached_commit(name, hub)
    commit, _ = _list(name, hub)
    return commit


def pinned_model(model: str | None) -> str | None:
    """A hub name at the commit it stands for now (ORG/NAME@COMMIT[:QUANT]); any other model as it is."""
    name = parse_hub_name(model) if model and not Path(model).expanduser().exists() else None
    if name is None:
        return model
    commit = pin(name)
    return name.pinned(commit) if commit else model


# ---------------------------------------------------------------------------------------------- the hub

def _list(name: HubName, hub: _Hub) -> tuple[str | None, dict[str, int] | str]:
    """(commit, {file: size}), or (None, why) when the hub cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=hub.endpoint)
    try:
        info = api.model_info(name.repo_id, revision=name.revision)
        commit = str(info.sha)
        listing = {entry.path: int(entry.lfs.size if entry.lfs is not None else entry.size)
                   for entry in api.list_repo_tree(name.repo_id, revision=commit, recursive=True)
                   if isinstance(entry, RepoFile)}
    except GatedRepoError as exc:
        raise ModelError(f"{name.repo_id} is gated: accept its conditions at {hub.endpoint}/{name.repo_id}, then "
                         f"{_login_hint()}") from exc
    except RevisionNotFoundError as exc:
        raise ModelError(f"{name.repo_id} has no revision {name.revision!r}: give a branch, tag or commit "
                         "of it") from exc
    except RepositoryNotFoundError as exc:
        raise ModelError(f"no model {name.repo_id!r} on the hub at {hub.endpoint} (and no local directory of that "
                         f"name): check the name; if it is private, {_login_hint()}") from exc
    except _transport_errors() as exc:
        return None, f"the hub at {hub.endpoint} did not answer ({type(exc).__name__})"
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise ModelError(f"the hub at {hub.endpoint} refused access to {name.repo_id} ({status}): "
                             f"{_login_hint()}") from exc
        if status is not None and status >= 500:
            return None, f"the hub at {hub.endpoint} answered {status}"
        raise ModelError(f"the hub at {hub.endpoint} refused {name.repo_id}: "
                         f"{str(exc).strip().splitlines()[0]}") from exc
    return commit, listing


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What the client raises when the hub does not answer: its HTTP library's (httpx2 in huggingface_hub 2,
    httpx in 1) connection errors, and its own offline refusal."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    found: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module, attribute in (("httpx2", "TransportError"), ("httpx", "TransportError")):
        try:
            found.append(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _login_hint() -> str:
    from huggingface_hub import get_token

    if get_token():
        return ("the token in use (HF_TOKEN or `hf auth login`) has no access to it: use a token of an account "
                "that has")
    return "log in with `hf auth login` or set HF_TOKEN to a token of an account that has access"


def _choose(name: HubName, listing: dict[str, int]) -> list[str]:
    """The files of the repository a run reads: one GGUF file, or config + tokenizer + safetensors."""
    ggufs = sorted(path for path in listing if path.endswith(".gguf"))
    if name.gguf:
        return [_pick_gguf(name, name.gguf, ggufs)]
    top = [path for path in listing if "/" not in path]
    weights = _safetensors(name, listing, top)
    if not weights:
        if ggufs:
            quant = DEFAULT_QUANT if any(_quant_matches(path, DEFAULT_QUANT) for path in ggufs) else None
            if quant is None and len(ggufs) != 1:
                raise ModelError(f"{name.repo_id} holds GGUF files, not safetensors: name one, as "
                                 f"{name.repo_id}:QUANT or with --gguf-file (it has {_quants(ggufs)})")
            return [_pick_gguf(name, quant or ggufs[0], ggufs)]
        others = sorted(path for path in listing if path.endswith((".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack")))
        has = f" (it has {', '.join(others[:4])})" if others else ""
        raise ModelError(f"{name.repo_id} holds no safetensors or GGUF weights{has}: bulkgen reads those two; "
                         "convert it to safetensors and give the local directory")
    if "config.json" not in listing:
        raise ModelError(f"{name.repo_id} has no config.json: it is not a Hugging Face model bulkgen can run")
    extras = [path for path in top if any(fnmatch.fnmatch(path, pattern) for pattern in RUN_FILES)]
    return sorted(set(extras) | set(weights))


def _safetensors(name: HubName, listing: dict[str, int], top: list[str]) -> list[str]:
    if INDEX in listing:
        return [INDEX]  # its shards are read from it once it is here (_shards)
    if "model.safetensors" in listing:
        return ["model.safetensors"]
    return sorted(path for path in top if path.endswith(".safetensors") and not path.startswith("consolidated"))


def _pick_gguf(name: HubName, want: str, ggufs: list[str]) -> str:
    if want.endswith(".gguf"):
        found = [path for path in ggufs if path == want or PurePosixPath(path).name == want]
    else:
        found = [path for path in ggufs if _quant_matches(path, want)]
    if not found:
        what = "GGUF files" if ggufs else "no GGUF file"
        listed = f": {_quants(ggufs)}" if ggufs else ""
        raise ModelError(f"{name.repo_id} has no GGUF file {want!r}; it has {what}{listed}")
    if any(SPLIT_GGUF.search(path) for path in found):
        raise ModelError(f"{name.repo_id}'s {want} is split into several files ({found[0]}, ...): bulkgen reads "
                         "one-file GGUF; merge them with `llama-gguf-split --merge` and give the merged file")
    if len(found) > 1:
        found = [path for path in found if "/" not in path] or found
    if len(found) > 1:
        raise ModelError(f"{name.repo_id} has {len(found)} GGUF files for {want!r} ({', '.join(found[:4])}): "
                         "pick one with --gguf-file or ORG/NAME:FILE.gguf")
    return found[0]


def _quant_matches(path: str, quant: str) -> bool:
    stem = PurePosixPath(path).name[:-len(".gguf")]
    return re.search(rf"(^|[-._]){re.escape(quant)}($|[-._])", stem, re.IGNORECASE) is not None


def _quants(ggufs: list[str]) -> str:
    shown = [PurePosixPath(path).name for path in ggufs[:8]]
    return ", ".join(shown) + (f" and {len(ggufs) - 8} more" if len(ggufs) > 8 else "")


# ---------------------------------------------------------------------------------------------- download

def _download(name: HubName, hub: _Hub, commit: str, files: list[str], listing: dict[str, int], log: Log) -> None:
    snapshot = _snapshot_dir(name, hub, commit)
    missing = [path for path in files if not (snapshot / path).is_file()]
    if missing:
        _fetch_files(name, hub, commit, missing, listing, log)
    if files == [INDEX]:
        shards = _shards(name, snapshot / INDEX)
        missing = [path for path in shards if not (snapshot / path).is_file()]
        unknown = [path for path in shards if path not in listing]
        if unknown:
            raise ModelError(f"{name.repo_id}'s {INDEX} names {unknown[0]}, which the repository does not hold")
        if missing:
            _fetch_files(name, hub, commit, missing, listing, log)


def _fetch_files(name: HubName, hub: _Hub, commit: str, files: list[str], listing: dict[str, int], log: Log) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    needed = sum(listing.get(path, 0) for path in files)
    free = shutil.disk_usage(_existing(hub.cache)).free
    if needed + DISK_MARGIN_BYTES > free:
        raise ModelError(f"{name.repo_id} needs {_gb(needed)} in {hub.cache} and the disk has {_gb(free)} free: "
                         "free space, or point HF_HUB_CACHE (or HF_HOME) at a larger disk")
    log(f"bulkgen: downloading {name.repo_id}@{commit[:12]} ({len(files)} files, {_gb(needed)}) into {hub.cache}")
    quiet = not sys.stderr.isatty() and not are_progress_bars_disabled()
    if quiet:  # a bar off a terminal is a wall of carriage returns in a log: one line before, one after
        disable_progress_bars()
    try:
        snapshot_download(name.repo_id, revision=commit, allow_patterns=files, cache_dir=hub.cache,
                          endpoint=hub.endpoint)
    except HfHubHTTPError as exc:
        raise ModelError(f"downloading {name.repo_id} from {hub.endpoint} failed: "
                         f"{str(exc).strip().splitlines()[0]}") from exc
    except OSError as exc:
        raise ModelError(f"downloading {name.repo_id} from {hub.endpoint} failed ({type(exc).__name__}: {exc}); "
                         "run again to resume it") from exc
    finally:
        if quiet:
            enable_progress_bars()
    log(f"bulkgen: {name.repo_id}@{commit[:12]} is in {hub.cache}")


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def _shards(name: HubName, index: Path) -> list[str]:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ModelError(f"{name.repo_id}'s {INDEX} is not a safetensors index ({exc})") from exc


# ---------------------------------------------------------------------------------------------- the cache

def _snapshot_dir(name: HubName, hub: _Hub, commit: str) -> Path:
    return hub.cache / f"models--{name.repo_id.replace('/', '--')}" / "snapshots" / commit


def _cached_commit(name: HubName, hub: _Hub) -> str | None:
    if name.revision and COMMIT.fullmatch(name.revision):
        return name.revision
    ref = hub.cache / f"models--{name.repo_id.replace('/', '--')}" / "refs" / (name.revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def _from_cache(name: HubName, hub: _Hub, why: str) -> HubModel:
    """The run's files from the hub cache alone (offline, or the hub did not answer)."""
    if hub.offline:
        fixes = "unset HF_HUB_OFFLINE to download it, or give a local directory"
    else:
        fixes = ("connect this machine, point HF_ENDPOINT at a mirror, fill the cache where the hub answers and set "
                 "HF_HUB_OFFLINE=1 here, or give a local directory")
    commit = _cached_commit(name, hub)
    shown = f"{name.repo_id}@{name.revision}" if name.revision else name.repo_id
    snapshot = _snapshot_dir(name, hub, commit) if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise ModelError(f"{why}, and {shown} is not in the hub cache {hub.cache}: {fixes}")
    listing = {path.relative_to(snapshot).as_posix(): 0 for path in snapshot.rglob("*") if path.is_file()}
    try:
        files = _choose(name, listing)
    except ModelError as exc:
        raise ModelError(f"{why}, and the cached {shown} is not complete ({exc}): {fixes}") from exc
    if files == [INDEX]:
        absent = [path for path in _shards(name, snapshot / INDEX) if path not in listing]
        if absent:
            raise ModelError(f"{why}, and the cached {shown} lacks {absent[0]}: {fixes}")
    return _located(name, hub, commit, files)


def _located(name: HubName, hub: _Hub, commit: str, files: list[str]) -> HubModel:
    snapshot = _snapshot_dir(name, hub, commit)
    if name.gguf or files[0].endswith(".gguf"):
        return HubModel(snapshot / files[0], commit, gguf=True)
    return HubModel(snapshot, commit, gguf=False)

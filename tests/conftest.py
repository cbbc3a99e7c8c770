"""Shared fixtures: a fresh database per test, the real default model, and tiny random models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is unreachable here; never wait for it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels run on the CPU, through triton's interpreter

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def db_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'bulkgen.db'}"
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

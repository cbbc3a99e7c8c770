"""Model families beyond Llama: what bulkgen cannot run exactly is refused, never run wrong.

Sliding-window attention (Mistral, Gemma 2/3, gpt-oss, Phi-3, Cohere 2, OLMo 3, ...) is not in the engine
yet: a sequence within the window runs exactly (every position attends to all before it, as the model's
own masks give), and one that would pass it is refused, at submit as that row's error and in the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.errors import ModelError, PromptTooLongError
from bulkgen.model import sliding_window
from bulkgen.store.db import open_store
from bulkgen.store.models import Request
from tests.helpers import hf_greedy, invoke, invoke_json, write_parquet

WINDOW = 24


def tiny_model(out: Path, tokenizer_dir: Path, config_class: str, seed: int = 4, **fields) -> Path:
    """A random model of one of transformers' config classes, tiny, with SmolLM2's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        initializer_range=0.2, **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny-mistral"), default_model_dir, "MistralConfig",
                      sliding_window=WINDOW)


def test_the_sliding_window_is_read_as_transformers_reads_configs() -> None:
    import transformers as t

    assert sliding_window(t.MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(t.MistralConfig(sliding_window=None)) is None
    assert sliding_window(t.Gemma2Config()) == 4096  # layer_types: sliding and full layers
    assert sliding_window(t.GptOssConfig()) == 128
    assert sliding_window(t.Qwen2Config(sliding_window=64)) is None  # use_sliding_window is off by default
    assert sliding_window(t.Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=0)) == 64
    assert sliding_window(t.LlamaConfig()) is None
    assert sliding_window(t.Gemma2Config(layer_types=["full_attention"] * 26)) is None


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_within_its_window_a_sliding_model_equals_hf_generate_and_past_it_is_refused(tiny_mistral_dir: Path,
                                                                                     kernels: str) -> None:
    rng = random.Random(0)
    workload = [([rng.randrange(100, 40000) for _ in range(n)], WINDOW - n) for n in (1, 5, 12, 20, 23)]
    want = hf_greedy(tiny_mistral_dir, workload, exact_length=True)
    engine = Engine(tiny_mistral_dir, EngineConfig(kv_cache_memory=4 * 2**20, block_size=16, kernels=kernels))
    got = engine.generate([p for p, _ in workload],
                          [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in workload])
    assert [o.output_token_ids for o in sorted(got, key=lambda o: o.request_id)] == want
    with pytest.raises(PromptTooLongError, match=f"sliding window of {WINDOW} tokens, which bulkgen does not run"):
        engine.add("past", list(range(100, 120)), SamplingParams(max_new_tokens=WINDOW - 19))
    assert not engine.has_unfinished(), "nothing of a refused request stays in the engine"


def test_rows_past_the_window_fail_at_submit_and_the_rest_run(tmp_path: Path, db_url: str,
                                                              tiny_mistral_dir: Path) -> None:
    data = write_parquet(tmp_path / "rows.parquet", {"prompt": ["Hi", "word " * 40, "Hello there"]})
    out = invoke_json("submit", data, "--model", tiny_mistral_dir, "--max-new-tokens", 8)
    assert out["num_requests"] == 3 and out["num_failed"] == 1
    invoke("run", out["job_id"], "--kv-cache-memory", "4MiB", "--no-progress")
    store = open_store(db_url)
    with store.session_scope() as session:
        requests = session.query(Request).filter_by(job_id=out["job_id"]).order_by(Request.row)
        rows = [(r.state, r.error) for r in requests]
    assert [state for state, _ in rows] == ["completed", "failed", "completed"]
    assert f"sliding window of {WINDOW} tokens, which bulkgen does not run yet" in rows[1][1]
    # a budget that leaves no prompt room in the window is a bad flag: refused before anything is written
    refused = invoke("submit", data, "--model", tiny_mistral_dir, "--max-new-tokens", WINDOW, expect=2)
    assert "leaves no room for a prompt" in refused.output and f"sliding window of {WINDOW}" in refused.output
    assert [job["id"] for job in invoke_json("list")] == [out["job_id"]]


@pytest.mark.parametrize(("config_class", "fields", "feature"), [
    ("Gemma2Config", dict(head_dim=16, layer_types=["full_attention"] * 2), "attention logit softcapping"),
    ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"] * 2),
     "attention sinks"),
    ("Qwen3NextConfig", dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"]),
     "layers of type linear_attention"),
    ("Lfm2Config", dict(layer_types=["conv", "full_attention"]), "layers of type conv"),
    ("MambaConfig", dict(), "layers of type linear_attention"),
])
def test_attention_features_bulkgen_lacks_are_refused_at_load(tmp_path: Path, default_model_dir: Path,
                                                             config_class: str, fields: dict, feature: str) -> None:
    """Run by bulkgen these would differ from the model at every length: refused with the model class and
    the feature, before any request is taken (ModelError: exit 2 in the CLI). Linear attention, short
    convolutions and state-space mixers carry a state from token to token that the paged KV cache does
    not hold (Qwen3-Next and LFM2 ran before, silently wrong; Mamba crashed in oneDNN)."""
    model_dir = tiny_model(tmp_path / config_class, default_model_dir, config_class, **fields)
    with pytest.raises(ModelError, match=f"uses {feature}.*cannot run this model exactly"):
        Engine(model_dir, EngineConfig(kv_cache_memory=4 * 2**20))


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_stablelm_whose_layers_keep_attention_arguments_to_themselves_equals_hf_generate(
        tmp_path: Path, default_model_dir: Path, kernels: str) -> None:
    """StableLM's decoder layers do not pass transformers' keyword arguments on to the attention function
    (a KeyError before): the step's metadata reaches it anyway. Partial rotary (a quarter of each head)."""
    model_dir = tiny_model(tmp_path / "stablelm", default_model_dir, "StableLmConfig", partial_rotary_factor=0.25)
    rng = random.Random(1)
    workload = [([rng.randrange(100, 40000) for _ in range(n)], m) for n, m in ((1, 9), (17, 20), (60, 33))]
    want = hf_greedy(model_dir, workload, exact_length=True)
    engine = Engine(model_dir, EngineConfig(kv_cache_memory=4 * 2**20, block_size=16, kernels=kernels,
                                            max_num_batched_tokens=32))
    got = engine.generate([p for p, _ in workload], [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                     for _, n in workload])
    assert [o.output_token_ids for o in sorted(got, key=lambda o: o.request_id)] == want

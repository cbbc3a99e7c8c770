"""Model families beyond Llama, each run exactly or refused, never run wrong.

Every family below is a tiny random model of transformers' own config class with its features switched on
(sliding windows of a few tokens so that prompts cross them, hybrid layers, softcapping, sinks, MoE, q/k
norms, partial rotary), compared with Hugging Face generate() greedy on the same weights, token for token:
prompts shorter than, at and past the window, outputs that run past it, with chunked prefill (chunks that
straddle the window), a prefix-cache hit and preemption in play, on the C path, the torch path and Triton's
(in its interpreter). What bulkgen cannot compute (layers that carry a state) is refused at load."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.errors import ModelError
from bulkgen.model import ModelShape, read_config, sliding_window
from bulkgen.store.db import open_store
from bulkgen.store.models import Request
from tests.helpers import hf_greedy, invoke, invoke_json, write_parquet

WINDOW = 24  # not a multiple of the block size (16): the window's edge falls inside a block


def tiny_model(out: Path, tokenizer_dir: Path, config_class: str, seed: int = 4, **fields) -> Path:
    """A random model of one of transformers' config classes, tiny, with SmolLM2's tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, initializer_range=0.2)
    config = getattr(transformers, config_class)(**{**sizes, **fields})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# family -> (config class, fields): each with the attention features its real models use
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SLIDING = {
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2-hybrid": ("Qwen2Config", dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, partial_rotary_factor=0.5)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", dict(sliding_window=WINDOW, **MOE)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=8.0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "gpt-oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, **MOE)),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "olmo3": ("Olmo3Config", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: tiny_model(root / name, default_model_dir, cls, **fields) for name, (cls, fields) in SLIDING.items()}


def _workload() -> list[tuple[list[int], int]]:
    """Prompts below, at and past the window, outputs that pass it; two share a 40-token prefix (a prefix-cache
    hit once the first has run)."""
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    lengths = [(3, 30), (WINDOW - 1, 6), (WINDOW, 5), (WINDOW + 1, 20), (2 * WINDOW + 5, 12), (70, 3)]
    workload = [([rng.randrange(100, 40000) for _ in range(n)], m) for n, m in lengths]
    return workload + [(shared + [rng.randrange(100, 40000) for _ in range(n)], 10) for n in (5, 9)]


_HF: dict[str, list[list[int]]] = {}


def _hf(name: str, model_dir: Path, workload: list[tuple[list[int], int]]) -> list[list[int]]:
    if name not in _HF:
        _HF[name] = hf_greedy(model_dir, workload, exact_length=True)
    return _HF[name]


def _run(model_dir: Path, workload: list[tuple[list[int], int]], **config) -> tuple[list[list[int]], Engine]:
    """The workload's greedy outputs through one engine: all but the last two requests, then the one before last
    alone, then the last alone (which shares its prefix with the one before it: cached blocks to take; alone,
    since a sliding layer's blocks are given back as its window passes and, once reused, cannot be taken)."""
    engine = Engine(model_dir, EngineConfig(block_size=16, max_num_batched_tokens=20, enable_prefix_caching=True,
                                            **config))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in workload]
    got = list(engine.generate([p for p, _ in workload[:-2]], params[:-2]))
    engine.add(len(workload) - 2, workload[-2][0], params[-2])
    while engine.has_unfinished():
        got.extend(engine.step())
    engine.add(len(workload) - 1, workload[-1][0], params[-1])
    computed = engine.stats.num_prompt_tokens_computed
    while engine.has_unfinished():
        got.extend(engine.step())
    engine.prefix_hit = engine.stats.num_prompt_tokens_computed - computed < len(workload[-1][0])
    return [o.output_token_ids for o in sorted(got, key=lambda o: o.request_id)], engine


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("family", list(SLIDING))
def test_each_family_equals_hf_generate_past_its_window(family_dirs: dict[str, Path], family: str,
                                                        kernels: str) -> None:
    """Chunks of 20 tokens straddle the window's edge; a 160-token KV cache (10 blocks) holds the longest
    request but not all at once, so sequences are preempted and recomputed."""
    workload = _workload()
    want = _hf(family, family_dirs[family], workload)
    got, engine = _run(family_dirs[family], workload, kv_cache_memory=_kv_bytes(family_dirs[family], 10),
                       kernels=kernels)
    assert got == want
    assert engine.stats.num_preemptions >= 1 and engine.prefix_hit, "preemption and a prefix hit were in play"


# (Mistral's window on every layer is the window the others have on some: qwen2-hybrid's, gemma2's, gpt-oss's)
@pytest.mark.parametrize("family", ["qwen2-hybrid", "gemma2", "gemma3", "gpt-oss"])
def test_each_family_equals_hf_generate_on_the_triton_path(family_dirs: dict[str, Path], family: str) -> None:
    """The Triton kernels (in Triton's interpreter): windows, softcapping and sinks as on the other paths."""
    pytest.importorskip("triton")
    # 12 new tokens at most (greedy outputs are prefixes of the longer ones): every window is still passed, by a
    # prompt or by its output, at a third of the interpreter's decode steps
    workload = [(prompt, min(n, 12)) for prompt, n in _workload()[:6]]
    want = [out[:n] for out, (_, n) in zip(_hf(family, family_dirs[family], _workload())[:6], workload, strict=True)]
    got, _ = _run(family_dirs[family], workload, kv_cache_memory=_kv_bytes(family_dirs[family], 12),
                  attention_backend="triton")
    assert got == want


def test_sliding_layers_hold_kv_for_their_window_only(tmp_path: Path, default_model_dir: Path) -> None:
    """A Gemma-3-shaped model (five sliding layers to one full) in a KV cache of 24 blocks of every layer's K/V:
    a 100-token request needs 7 blocks of them, so 3 would run at once if every layer held the whole context;
    sliding layers holding their window only (3 blocks of 16 for 24 tokens), 6 run at once, admitted by the
    packer's projection without a preemption, with Hugging Face's outputs."""
    from bulkgen.packing import admission_for

    model_dir = tiny_model(tmp_path / "gemma3", default_model_dir, "Gemma3TextConfig", head_dim=16,
                           sliding_window=WINDOW, num_hidden_layers=6,
                           layer_types=["sliding_attention"] * 5 + ["full_attention"])
    rng = random.Random(1)
    workload = [([rng.randrange(100, 40000) for _ in range(20)], 80) for _ in range(10)]
    engine = Engine(model_dir, EngineConfig(block_size=16, kv_cache_memory=_kv_bytes(model_dir, 24)),
                    admission=admission_for("sorted"))
    assert engine.runner.layout.group_windows == (0,) + (WINDOW,) * 5
    engine.stats.keep_steps = True
    got = engine.generate([p for p, _ in workload], [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                     for _, n in workload])
    got = [o.output_token_ids for o in sorted(got, key=lambda o: o.request_id)]
    assert got == hf_greedy(model_dir, workload, exact_length=True)
    # (drafts move sequences apart, and the projection may then fit a seventh)
    assert max(step.num_seqs for step in engine.stats.steps) >= 6 and engine.stats.num_preemptions == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # all given back


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sampled_and_constrained_requests_past_the_window_are_their_seeds(family_dirs: dict[str, Path],
                                                                          family: str) -> None:
    """Sampled (T 0.8, top-p 0.95), every other one constrained to a JSON schema, past the window: each request's
    tokens alone in a roomy cache equal its tokens among the others in a tight one (chunked prefill, preemption,
    sliding blocks given back and taken again); a constrained output the grammar finished validates."""
    import json

    import jsonschema

    from tests.test_sampling_matrix import SCHEMA, SCHEMA_TEXT

    model_dir = family_dirs[family]
    prompts = [p for p, _ in _workload()]
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=i,
                             json_schema=SCHEMA_TEXT if i % 2 else None) for i in range(len(prompts))]

    def run(indexes: list[int], num_blocks: int) -> tuple[list, Engine]:
        engine = Engine(model_dir, EngineConfig(block_size=16, max_num_batched_tokens=20,
                                                kv_cache_memory=_kv_bytes(model_dir, num_blocks)))
        outs = engine.generate([prompts[i] for i in indexes], [params[i] for i in indexes])
        return sorted(outs, key=lambda o: o.request_id), engine

    together, engine = run(list(range(len(prompts))), 10)
    assert engine.stats.num_preemptions >= 1
    for i, out in enumerate(together):
        assert out.error is None and out.finish_reason in ("stop", "eos", "length"), (i, out.error)
        if params[i].json_schema is not None and out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    alone = [run([i], 64)[0][0].output_token_ids for i in range(len(prompts))]
    assert [out.output_token_ids for out in together] == alone


def _kv_bytes(model_dir: Path, num_blocks: int) -> int:
    return ModelShape.of(read_config(model_dir)).kv_bytes_per_token("float32") * 16 * num_blocks


def test_each_layers_window_is_read_as_transformers_reads_configs() -> None:
    import transformers as t

    assert sliding_window(t.MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(t.MistralConfig(sliding_window=None)) is None
    assert sliding_window(t.Gemma2Config()) == 4096  # layer_types: sliding and full layers
    assert sliding_window(t.GptOssConfig()) == 128
    assert sliding_window(t.Qwen2Config(sliding_window=64)) is None  # use_sliding_window is off by default
    assert sliding_window(t.Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=0)) == 64
    assert sliding_window(t.LlamaConfig()) is None
    assert sliding_window(t.Gemma2Config(layer_types=["full_attention"] * 26)) is None
    assert ModelShape.of(t.Gemma3TextConfig(sliding_window=512, num_hidden_layers=12)).windows == (512,) * 5 + (0,) \
        + (512,) * 5 + (0,)
    assert ModelShape.of(t.MistralConfig(sliding_window=32, num_hidden_layers=2)).windows == (32, 32)
    assert ModelShape.of(t.LlamaConfig(num_hidden_layers=2)).windows == (0, 0)


def test_a_sliding_model_runs_past_its_window_through_the_queue(tmp_path: Path, db_url: str,
                                                                family_dirs: dict[str, Path]) -> None:
    """Rows longer than the window are generated, not refused (they were, while the engine did not slide)."""
    data = write_parquet(tmp_path / "rows.parquet", {"prompt": ["Hi", "word " * 40, "Hello there"]})
    out = invoke_json("submit", data, "--model", family_dirs["gemma3"], "--max-new-tokens", 30)
    assert out["num_requests"] == 3 and out["num_failed"] == 0
    invoke("run", out["job_id"], "--kv-cache-memory", "4MiB", "--no-progress")
    store = open_store(db_url)
    with store.session_scope() as session:
        requests = session.query(Request).filter_by(job_id=out["job_id"]).order_by(Request.row)
        assert [r.state for r in requests] == ["completed"] * 3


@pytest.mark.parametrize(("config_class", "fields", "feature"), [
    ("Qwen3NextConfig", dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                             linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"]),
     "layers of type linear_attention"),
    ("Lfm2Config", dict(layer_types=["conv", "full_attention"]), "layers of type conv"),
    ("MambaConfig", dict(), "layers of type linear_attention"),
    ("Llama4TextConfig", dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128, attention_chunk_size=16),
     "layers of type chunked_attention"),
    # the probe at load: what reaches bulkgen's attention, and how
    ("BertConfig", dict(), "mask lets a token see the tokens after it"),
    ("DiffLlamaConfig", dict(), "calls bulkgen's attention 4 times for its 2 layers"),
    ("BloomConfig", dict(n_layer=2, n_head=4), "calls bulkgen's attention 0 times"),
    ("DeepseekV3Config", dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                              moe_intermediate_size=32), "gives K/V of 4 heads x 16 dims"),
])
def test_attention_features_bulkgen_lacks_are_refused_at_load(tmp_path: Path, default_model_dir: Path,
                                                             config_class: str, fields: dict, feature: str) -> None:
    """Run by bulkgen these would differ from the model at every length: refused with the model class and
    the feature, before any request is taken (ModelError: exit 2 in the CLI). Linear attention, short
    convolutions and state-space mixers carry a state from token to token that the paged KV cache does
    not hold (Qwen3-Next and LFM2 ran before, silently wrong; Mamba crashed in oneDNN). The probe at load
    finds the rest: a BERT used as a decoder attends both ways, DiffLlama runs two softmaxes a layer and
    Bloom attends in its own code (each ran before, silently wrong), multi-head latent attention gives
    K/V of other shapes than its config's heads (it crashed)."""
    model_dir = tiny_model(tmp_path / config_class, default_model_dir, config_class, **fields)
    with pytest.raises(ModelError, match=feature) as refused:
        Engine(model_dir, EngineConfig(kv_cache_memory=4 * 2**20))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[read_config(model_dir).model_type]
    assert str(refused.value).startswith(model_class), "the message names the model's class first"


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

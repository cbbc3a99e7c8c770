"""The engine's greedy output equals Hugging Face generate(), token for token (fp32, CPU).

Under plenty of memory, a KV cache small enough to force many preemptions, and a token budget small
enough to force chunked prefill; through our lean forward (with the C kernels, and with pure torch)
and through Hugging Face's modules."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from bulkgen.bench.workload import distinct_tokens
from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.cpu.kernels import CFLAGS_ENV
from bulkgen.engine.cpu.machine import ALLOW_SLOW_DTYPE_ENV
from bulkgen.engine.engine import Engine
from bulkgen.errors import ConfigError
from tests import helpers
from tests.builds import HAS_AVX512_BF16, HAS_AVX512F

NUM_PROMPTS = 44
KV_BYTES_PER_TOKEN = {"llama": 2 * 2 * 2 * 16 * 4, "llama64": 2 * 2 * 2 * 64 * 4, "qwen2": 2 * 2 * 2 * 16 * 4}


def _workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 3, 15, 16, 17, 31, 32, 33, 299, 300] + [rng.randint(1, 300) for _ in range(NUM_PROMPTS - 11)]
    return [([rng.randrange(100, 40000) for _ in range(n)], rng.randint(1, 64)) for n in lengths]


WORKLOAD = _workload()


def hf_greedy(model_dir: Path) -> list[list[int]]:
    return helpers.hf_greedy(model_dir, WORKLOAD)


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tiny_llama64_dir: Path, tiny_qwen2_dir: Path) -> dict[str, tuple[Path, list]]:
    dirs = {"llama": tiny_model_dir, "llama64": tiny_llama64_dir, "qwen2": tiny_qwen2_dir}
    return {name: (path, hf_greedy(path)) for name, path in dirs.items()}


SETTINGS = {
    "plenty": dict(kv_tokens=1 << 16, max_num_batched_tokens=1024, block_size=16),
    # The longest request needs 364 tokens; small blocks make every sequence grow often.
    "tight-kv": dict(kv_tokens=380, max_num_batched_tokens=1024, block_size=4),
    "chunked": dict(kv_tokens=1 << 16, max_num_batched_tokens=16, block_size=8),
}


# Our lean Llama-family forward with every kernel family in C (as built for this CPU, and as built for
# AVX2: the code an AVX2 machine runs), the same in pure torch, and Hugging Face's own modules with our
# attention plugged in.
PATHS = {"lean-c": ("c", True, ""), "lean-c-avx2-build": ("c", True, "-mno-avx512f"),
         "lean-torch": ("torch", True, ""), "hf-modules": ("c", False, "")}


# Every pair of a family, a setting and a path, in 12 cases where all three at once would take 36 (a Latin
# rectangle: path i with setting j runs family (i + j) mod 3): each path meets each family and each setting, and
# each setting each family. What only a kernel's build changes is tested kernel by kernel on every build
# (test_attention_kernel.py, test_cpu_ops.py).
FAMILIES = ("llama", "llama64", "qwen2")
CASES = [(FAMILIES[(i + j) % len(FAMILIES)], setting, path)
         for i, path in enumerate(PATHS) for j, setting in enumerate(SETTINGS)]


@pytest.mark.parametrize(("family", "setting", "path"), CASES)
def test_greedy_equals_hf_generate(models, family: str, setting: str, path: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir, expected = models[family]
    s = SETTINGS[setting]
    kernels, lean, cflags = PATHS[path]
    if cflags and not HAS_AVX512F:
        pytest.skip("this CPU has no AVX-512: its native build is the AVX2 code, which lean-c runs")
    monkeypatch.setenv(CFLAGS_ENV, cflags)
    config = EngineConfig(kv_cache_memory=s["kv_tokens"] * KV_BYTES_PER_TOKEN[family],
                          max_num_batched_tokens=s["max_num_batched_tokens"], kernels=kernels,
                          max_num_seqs=64, block_size=s["block_size"], fast_forward=lean)
    engine = Engine(model_dir, config)
    assert (engine.runner.forward is not None) == lean
    c_families = {name for name, p in engine.runner.paths.families.items() if p.use_c}
    linear = {"linear", "gated_mlp"} if lean else set()
    in_c = {"decode_attention", "prefill_attention", "small_ops", "sampler"} | linear if kernels == "c" else set()
    assert c_families == in_c, engine.runner.paths.lines()
    # Shortest first under a tight cache: many sequences are admitted together, then all grow.
    order = sorted(range(len(WORKLOAD)), key=lambda i: len(WORKLOAD[i][0])) if setting == "tight-kv" \
        else range(len(WORKLOAD))
    for i in order:
        engine.add(i, WORKLOAD[i][0], SamplingParams(max_new_tokens=WORKLOAD[i][1]))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    mismatches = [i for i, ref in enumerate(expected) if outputs[i].output_token_ids != ref]
    assert mismatches == [], f"{len(mismatches)} of {len(expected)} differ, e.g. #{mismatches[0]}"
    for i, (_, max_new) in enumerate(WORKLOAD):
        reason = outputs[i].finish_reason
        assert reason == ("eos" if expected[i][-1] == 2 and len(expected[i]) <= max_new else "length") or \
            (reason == "length" and len(expected[i]) == max_new)
    if setting == "tight-kv":
        assert engine.stats.num_preemptions >= 10, engine.stats.num_preemptions
    if setting == "chunked":
        assert engine.stats.num_steps > sum(len(p) for p, _ in WORKLOAD) / 16
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


@pytest.mark.slow
def test_default_model_matches_hf_generate(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from bulkgen.model import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain photosynthesis in one sentence.",
                 "Translate 'good morning' into Spanish."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            expected.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                           do_sample=False)[0, len(p):].tolist())
    engine = Engine(model, EngineConfig(kv_cache_memory=64 * 2**20), tokenizer=tok)
    outputs = {o.request_id: o for o in engine.generate(prompts, SamplingParams(max_new_tokens=40))}
    assert [outputs[i].output_token_ids for i in range(len(prompts))] == expected
    assert "Paris" in outputs[0].text


def test_bfloat16_kernels_agree_with_torch(tiny_llama64_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 through the C kernels (K in dim pairs, vdpbf16ps where the CPU has it, prefill in row tiles
    after cached chunks, paired P·V) against the same engine on pure-torch ops and attention. Both round
    differently, so greedy paths may part after a near-tie (a random tiny model has many); a wrong layout
    or mask would make them part at once. On a CPU without native bfloat16 (where bulkgen refuses the dtype
    unless told otherwise) the C linear layers decline it and torch emulates it: slow, but a tiny model."""
    monkeypatch.setenv(ALLOW_SLOW_DTYPE_ENV, "1")
    s = SETTINGS["chunked"]
    outputs = []
    c_kernels = "c" if HAS_AVX512_BF16 else "attention=c,small_ops=c"
    for kernels in (c_kernels, "torch"):
        config = EngineConfig(kv_cache_memory=s["kv_tokens"] * KV_BYTES_PER_TOKEN["llama64"] // 2,
                              max_num_batched_tokens=s["max_num_batched_tokens"], kernels=kernels,
                              max_num_seqs=64, block_size=32, dtype="bfloat16")
        engine = Engine(tiny_llama64_dir, config)
        for i, (prompt, max_new) in enumerate(WORKLOAD):
            engine.add(i, prompt, SamplingParams(max_new_tokens=max_new))
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.output_token_ids) for o in engine.step())
        outputs.append(done)
    kernel, torch_ = outputs
    first = sum(kernel[i][0] == torch_[i][0] for i in kernel) / len(kernel)
    common = [next((j for j, (a, b) in enumerate(zip(kernel[i], torch_[i], strict=True)) if a != b), len(kernel[i]))
              for i in kernel]
    before_parting = sum(common) / sum(len(out) for out in kernel.values())
    print(f"bfloat16 kernel vs torch: first token {first:.0%}, tokens before the paths part {before_parting:.0%}")
    assert first >= 0.9 and before_parting >= 0.3  # 65 % here; a broken decode path gives ~3 %


def _first(engine: Engine, caps: dict[int, int]) -> dict[int, list[int]]:
    """Up to caps[i] greedy tokens of each picked WORKLOAD prompt i, run together."""
    for i, cap in caps.items():
        engine.add(i, WORKLOAD[i][0], SamplingParams(max_new_tokens=min(WORKLOAD[i][1], cap)))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o.output_token_ids) for o in engine.step())
    return {i: outputs[i] for i in caps}


def test_triton_path_equals_hf_generate(models) -> None:
    """The GPU path (Triton attention, KV write and small ops; K laid out as V), here in Triton's CPU
    interpreter: greedy tokens equal Hugging Face's, with chunked prefill, cached prefixes and
    preemptions (a small cache), and decode contexts split over several programs."""
    pytest.importorskip("triton")
    model_dir, expected = models["llama64"]
    picked = [0, 3, 8, 10, 17]  # 1 to 300 prompt tokens
    config = EngineConfig(kv_cache_memory=336 * KV_BYTES_PER_TOKEN["llama64"], max_num_batched_tokens=64,
                          attention_backend="triton", max_num_seqs=8, block_size=16)
    engine = Engine(model_dir, config)
    assert type(engine.runner.backend).__name__ == "TritonBackend"
    assert engine.runner.kv.k_caches[0].shape[1:] == engine.runner.kv.v_caches[0].shape[1:]
    assert _first(engine, dict.fromkeys(picked, 16)) == {i: expected[i][:min(WORKLOAD[i][1], 16)] for i in picked}
    assert engine.stats.num_preemptions > 0


def test_decode_graphs_pad_to_their_bucket_and_equal_hf_generate(models) -> None:
    """CUDA-graph decode (its static buffers, buckets and scratch-block padding; here run eagerly in Triton's
    interpreter, as nothing can be captured without a GPU): greedy tokens equal Hugging Face's while the
    batch shrinks through buckets and its block tables widen. Prompts of 1 to 33 tokens: the prefill
    path is the one test_triton_path_equals_hf_generate runs over long prompts."""
    pytest.importorskip("triton")
    model_dir, expected = models["llama64"]
    caps = {0: 16, 1: 2, 3: 5, 8: 9, 13: 12}  # the batch shrinks as they end
    config = EngineConfig(kv_cache_memory=337 * KV_BYTES_PER_TOKEN["llama64"], max_num_batched_tokens=64,
                          attention_backend="triton", max_num_seqs=5, block_size=16, cuda_graphs=True)
    engine = Engine(model_dir, config)
    graphs = engine.runner.backend.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 5] and graphs.scratch_block == engine.runner.num_blocks
    assert sorted(graphs.graphs) == graphs.sizes, "every bucket is captured when the engine starts"
    made = dict(graphs.graphs)
    used = set()
    original_run = graphs.run

    def run(*args):
        used.add((graphs.bucket(len(args[0])), max(len(t) for t in args[3])))
        logits = original_run(*args)
        # a replay copies the rows of its bucket and the width in use, not tables as wide as the longest sequence
        bucket, width = graphs.bucket(len(args[0])), max(len(t) for t in args[3])
        assert graphs.copied == graphs._starts[-1] + bucket * width < graphs.buffer.numel()
        return logits

    graphs.run = run
    assert _first(engine, caps) == {i: expected[i][:min(WORKLOAD[i][1], cap)] for i, cap in caps.items()}
    assert len({bucket for bucket, _ in used}) >= 2, "decode steps of several sizes went through their buckets"
    assert len({width for _, width in used}) >= 2, "and of several table widths"
    assert graphs.graphs == made, "none captured during the run"
    with pytest.raises(ConfigError, match="needs a GPU"):
        Engine(model_dir, EngineConfig(kv_cache_memory=2**20, cuda_graphs=True, attention_backend="torch"))


def _shared_prefix_workload() -> list[tuple[list[int], int]]:
    """Three documents of 37-61 tokens, each asked five questions of 1-9 tokens: prompts that share full blocks and
    then part of a block; one prompt twice, and one four times in a row (a prompt's samples, as `--n 4` gives)."""
    rng = random.Random(7)
    workload = []
    for length in (37, 50, 61):
        document = [rng.randrange(100, 40000) for _ in range(length)]
        workload += [(document + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 9))], rng.randint(2, 12))
                     for _ in range(5)]
    return [*workload, workload[4], workload[9], workload[9], workload[9]]


@pytest.mark.parametrize("path", ["lean-c", "lean-torch", "triton"])
def test_shared_prefixes_reused_part_blocks_included_equal_hf_generate(tiny_qwen2_dir: Path, path: str) -> None:
    """Prompts sharing a document: the later ones wait for its blocks, take the full ones from the prefix cache and
    copy the partly shared one (block_manager._partial); greedy tokens equal Hugging Face's, on the C, torch and
    Triton (interpreter) paths, with prefill in chunks of 16, and the engine computes each document about once."""
    if path == "triton":
        pytest.importorskip("triton")
    workload = _shared_prefix_workload()
    expected = helpers.hf_greedy(tiny_qwen2_dir, workload)
    config = EngineConfig(kv_cache_memory=1 << 22, max_num_batched_tokens=16, block_size=16, max_num_seqs=8,
                          kernels="torch" if path == "lean-torch" else "c",
                          attention_backend="triton" if path == "triton" else "auto")
    engine = Engine(tiny_qwen2_dir, config)
    for i, (prompt, max_new) in enumerate(workload):
        engine.add(i, prompt, SamplingParams(max_new_tokens=max_new))
    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert [outputs[i].output_token_ids for i in range(len(workload))] == expected
    cached = [outputs[i].num_cached_tokens for i in range(len(workload))]
    assert any(n % 16 for n in cached), f"some prompt copied a partly shared block: {cached}"
    # a prompt given again computes only its last token: the rest of its last block is copied from the first one's
    # (open while it runs, kept once freed), the later copies waiting a step for it rather than computing it beside
    assert [cached[i] - len(workload[i][0]) for i in range(15, len(workload))] == [-1] * 4, cached
    # the prompts' trie has `distinct` tokens; each prompt computes at least its last token (the duplicate's is not
    # distinct), and a block shared by fewer than PARTIAL_MIN_TOKENS is computed again
    distinct = distinct_tokens([p for p, _ in workload])
    assert distinct + 1 <= engine.stats.num_prompt_tokens_computed <= distinct + 1 + 3 * len(workload), \
        (engine.stats.num_prompt_tokens_computed, distinct)

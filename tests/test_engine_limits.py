"""Finish reasons (stop string, stop token, EOS, length), refusals, and the KV budget under 10× load."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine
from bulkgen.errors import PromptTooLongError

PROMPT = list(range(1200, 1230))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(tiny_model_dir, EngineConfig(kv_cache_memory=32 * 2**20))


def one(engine: Engine, prompt: list[int], params: SamplingParams):
    return next(iter(engine.generate([prompt], params)))


def test_length(engine: Engine) -> None:
    out = one(engine, PROMPT, SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 7


def test_stop_string_ends_the_sequence_and_is_removed(engine: Engine) -> None:
    full = one(engine, PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = one(engine, PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True, stop=(stop, "never-there")))
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert stop not in out.text
    assert len(out.output_token_ids) < 40
    assert full.output_token_ids[:len(out.output_token_ids)] == out.output_token_ids


def test_stop_token_id(engine: Engine) -> None:
    full = one(engine, PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    token = full.output_token_ids[5]
    first = full.output_token_ids.index(token)
    out = one(engine, PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True, stop_token_ids=(token,)))
    assert out.finish_reason == "stop" and out.output_token_ids == full.output_token_ids[:first + 1]


def test_eos(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=8 * 2**20))
    full = one(engine, PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    token = full.output_token_ids[3]
    engine.eos_token_ids = frozenset([token])  # pretend the model's EOS is a token it will produce
    out = one(engine, PROMPT, SamplingParams(max_new_tokens=20))
    first = full.output_token_ids.index(token)
    assert out.finish_reason == "eos" and out.output_token_ids == full.output_token_ids[:first + 1]
    ignored = one(engine, PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert ignored.finish_reason == "length" and len(ignored.output_token_ids) == 20
    assert token not in ignored.output_token_ids  # ignore_eos masks the EOS token, as HF's min_new_tokens


def test_too_long_prompts_are_refused_clearly(tiny_short_model_dir: Path) -> None:
    engine = Engine(tiny_short_model_dir, EngineConfig(kv_cache_memory=8 * 2**20))
    with pytest.raises(PromptTooLongError, match="the prompt has 64 tokens; the model's context is 64 tokens"):
        engine.add("long", list(range(100, 164)))
    with pytest.raises(PromptTooLongError, match="empty"):
        engine.add("empty", [])
    # The engine carries on; a request reaching the context limit ends with "length".
    out = one(engine, list(range(100, 160)), SamplingParams(max_new_tokens=50, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.output_token_ids) == 4


def test_a_request_larger_than_the_whole_cache_is_refused(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=64 * 512, block_size=16))  # 64 tokens
    with pytest.raises(PromptTooLongError, match="raise --kv-cache-memory"):
        engine.add(0, list(range(100, 150)), SamplingParams(max_new_tokens=20))


def test_ten_times_oversubscribed_cache_completes_within_its_budget(tiny_model_dir: Path) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 120))] for _ in range(40)]
    params = [SamplingParams(max_new_tokens=rng.randint(10, 60), ignore_eos=True) for _ in prompts]
    total = sum(len(p) + s.max_new_tokens for p, s in zip(prompts, params, strict=True))
    bytes_per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    budget = total * bytes_per_token // 10
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=budget, block_size=8, max_num_seqs=64))
    assert engine.runner.kv_cache_bytes <= budget
    assert engine.runner.max_num_tokens * 10 <= total + 10 * 8
    outputs = list(engine.generate(prompts, params))
    assert sorted(o.request_id for o in outputs) == list(range(40))
    assert all(len(o.output_token_ids) == p.max_new_tokens for o, p in
               zip(sorted(outputs, key=lambda o: o.request_id), params, strict=True))
    assert engine.stats.num_preemptions > 0
    assert engine.runner.kv_cache_bytes <= budget  # never grown
    # Same tokens as with ample memory.
    ample = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=64 * 2**20))
    reference = {o.request_id: o.output_token_ids for o in ample.generate(prompts, params)}
    assert all(o.output_token_ids == reference[o.request_id] for o in outputs)


def test_a_kv_cache_larger_than_free_memory_is_refused(tiny_model_dir: Path) -> None:
    import psutil

    from bulkgen.errors import ConfigError

    too_big = psutil.virtual_memory().total * 2
    with pytest.raises(ConfigError, match="does not fit.*lower --kv-cache-memory"):
        Engine(tiny_model_dir, EngineConfig(kv_cache_memory=too_big))


def test_a_kv_cache_too_small_to_run_anything_says_what_flag_would(tiny_model_dir: Path) -> None:
    """The message names a --kv-cache-memory value (not a count of bytes), and that value runs."""
    import re

    from bulkgen.config import parse_size
    from bulkgen.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        Engine(tiny_model_dir, EngineConfig(kv_cache_memory=4096))
    found = re.search(r"give --kv-cache-memory (\d+[KM]iB) or more", str(refused.value))
    assert found and "bytes" not in str(refused.value), refused.value
    engine = Engine(tiny_model_dir, EngineConfig(kv_cache_memory=parse_size(found.group(1))))
    assert list(engine.generate([[5, 6, 7]], [SamplingParams(max_new_tokens=2, ignore_eos=True)]))


def test_an_output_cut_inside_a_character_drops_it(engine: Engine) -> None:
    """Byte-level tokenizers split a multi-byte character over tokens: an output cut by its budget between
    them decodes with a trailing U+FFFD, which is dropped (the token ids keep every byte)."""
    from bulkgen.engine.detokenizer import drop_incomplete_character

    ids = engine.tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = engine.tokenizer.decode(ids[:-1])
    assert cut.endswith("\ufffd"), "the emoji spans more than one token"
    assert drop_incomplete_character(cut) == "ok "
    assert drop_incomplete_character(engine.tokenizer.decode(ids)) == "ok 😀"


def test_a_default_kv_cache_is_no_bigger_than_the_engine_can_fill(tiny_model_dir: Path) -> None:
    """Without --kv-cache-memory a CPU engine takes a quarter of free memory up to 4 GiB, but no more than
    max_num_seqs sequences of the longest context need (the tiny model's 4 GiB were mostly never touched); and
    that many sequences of that length still run at once."""
    engine = Engine(tiny_model_dir, EngineConfig(max_num_seqs=3, max_model_len=100, block_size=16))
    runner = engine.runner
    per_block = runner.shape.kv_bytes_per_token("float32") * 16
    assert 3 * 7 <= runner.num_blocks <= 3 * 7 + 4 + 1  # 100 tokens: 7 blocks a sequence; a few spare
    assert runner.kv_cache_bytes <= (3 * 7 + 8) * per_block
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(60)] for _ in range(3)]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=40, ignore_eos=True)] * 3)
    assert sorted(len(o.output_token_ids) for o in outs) == [40, 40, 40]  # 60 + 40: each to the context's end
    assert engine.scheduler.num_preemptions == 0

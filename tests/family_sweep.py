"""Every causal-LM class transformers knows, run through bulkgen against Hugging Face generate(): a sweep for
the families no test names (not collected by pytest; about half an hour on 2 cores).

    python tests/family_sweep.py [MODEL_TYPE ...] [--json out.json]

For each model type of transformers' causal-LM mapping: a tiny random model of its config class (sizes,
token ids and a 16-token sliding window set where the class has them; skipped where it cannot be built that
small), greedy outputs of two prompts (3 and 40 tokens, 24 new tokens) from HF generate() and from bulkgen's
engine (torch path, chunked prefill of 20 tokens). Each ends MATCH, WRONG (the one outcome that must never
be: bulkgen ran it to other outputs), refused (ModelError or ConfigError at load, with the reason), error or
skip. Prints one line a type as it goes.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
from pathlib import Path

import torch

VOCAB = 1024
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, sliding_window=16, head_dim=16, initializer_range=0.2,
             moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             n_embd=64, n_layer=2, n_head=4, d_model=64, n_positions=256, num_layers=2, ffn_hidden_size=128,
             kv_channels=16, max_seq_len=256, seq_length=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, n_group=1, topk_group=1, shared_expert_intermediate_size=32, decoder_sparse_step=1,
             tie_word_embeddings=False)
MAX_WEIGHTS = 60_000_000  # a class whose sizes the fields above do not reach is skipped (not built for real)


class _Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Timeout()


def _tiny(config_class: type) -> object:
    """The config with SMALL's fields that it has; a field the class rejects is dropped and the rest tried again."""
    fields = {k: v for k, v in SMALL.items() if k in config_class().to_dict()}
    for _ in range(len(fields) + 1):
        try:
            return config_class(**fields)
        except Exception as exc:  # noqa: BLE001  (a config class validates in its own ways)
            bad = next((k for k in fields if k in str(exc)), None)
            if bad is None:
                raise
            fields.pop(bad)
    raise ValueError("no config")


def sweep(model_types: list[str], root: Path, tokenizer_dir: Path) -> dict[str, tuple[str, str]]:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from bulkgen.config import EngineConfig, SamplingParams
    from bulkgen.engine.engine import Engine

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, VOCAB) for _ in range(n)] for n in (3, 40)]
    signal.signal(signal.SIGALRM, _alarm)
    results: dict[str, tuple[str, str]] = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_types and model_type not in model_types:
            continue
        signal.alarm(150)
        try:
            results[model_type] = _one(model_type, getattr(transformers, CONFIG_MAPPING_NAMES[model_type]), root,
                                       tokenizer, prompts, AutoModelForCausalLM, Engine, EngineConfig, SamplingParams)
        except _Timeout:
            results[model_type] = ("error", "timed out")
        finally:
            signal.alarm(0)
        print(model_type, *results[model_type], flush=True)
    return results


def _one(model_type, config_class, root, tokenizer, prompts, auto_model, engine_class, engine_config, sampling):
    try:
        if getattr(config_class(), "is_encoder_decoder", False):
            return ("skip", "encoder-decoder")
        config = _tiny(config_class)
        with torch.device("meta"):
            count = sum(p.numel() for p in auto_model.from_config(config).parameters())
        if count > MAX_WEIGHTS:
            return ("skip", f"{count:,} weights at the sweep's sizes")
        torch.manual_seed(0)
        model = auto_model.from_config(config, dtype=torch.float32).eval()
        model_dir = root / model_type
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        want = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                     do_sample=False, pad_token_id=0)
                want.append(out[0, len(prompt):].tolist())
    except _Timeout:
        raise
    except Exception as exc:  # noqa: BLE001  (what transformers itself cannot build at these sizes)
        return ("skip", f"{type(exc).__name__}: {str(exc)[:150]}")
    try:
        engine = engine_class(model_dir, engine_config(block_size=16, kv_cache_memory=8 * 2**20, kernels="torch",
                                                       max_num_batched_tokens=20), tokenizer=tokenizer)
        got = list(engine.generate(prompts, [sampling(max_new_tokens=24, ignore_eos=True)] * 2))
    except _Timeout:
        raise
    except Exception as exc:  # noqa: BLE001
        kind = "refused" if type(exc).__name__ in ("ModelError", "ConfigError") else "error"
        return (kind, f"{type(exc).__name__}: {str(exc)[:300]}")
    got_ids = [o.output_token_ids for o in sorted(got, key=lambda o: o.request_id)]
    return ("MATCH" if got_ids == want else "WRONG", type(model).__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bulkgen.resolve import DEFAULT_MODEL, resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        results = sweep(args.model_types, Path(tmp), resolve_model(DEFAULT_MODEL).path)
    counts = {kind: sum(1 for k, _ in results.values() if k == kind) for kind in ("MATCH", "WRONG", "refused",
                                                                               "error", "skip")}
    print(counts)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

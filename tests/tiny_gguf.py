"""A tiny random Llama as a GGUF file, written with the `gguf` package: the real SmolLM2 file's tokenizer (its
`tokenizer.*` fields copied), two layers of width 64, the linear layers in Q8_0 blocks. A few MB, converted in
seconds, where the real 135M file takes tens of seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def make_tiny_gguf(out: Path, source: Path, seed: int = 0) -> Path:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    reader = GGUFReader(source)
    writer = GGUFWriter(out, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(WIDTH)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(7)  # mostly Q8_0
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
        array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if array else None)
    writer.add_vocab_size(vocab)

    rng = np.random.default_rng(seed)

    def linear(name: str, rows: int, cols: int) -> None:  # (out, in) as numpy holds it
        weights = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        writer.add_tensor(name, quantize(weights, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(WIDTH)).astype(np.float32))

    linear("token_embd.weight", vocab, WIDTH)
    head_dim = WIDTH // HEADS
    for layer in range(LAYERS):
        norm(f"blk.{layer}.attn_norm.weight")
        linear(f"blk.{layer}.attn_q.weight", WIDTH, WIDTH)
        linear(f"blk.{layer}.attn_k.weight", KV_HEADS * head_dim, WIDTH)
        linear(f"blk.{layer}.attn_v.weight", KV_HEADS * head_dim, WIDTH)
        linear(f"blk.{layer}.attn_output.weight", WIDTH, WIDTH)
        norm(f"blk.{layer}.ffn_norm.weight")
        linear(f"blk.{layer}.ffn_gate.weight", FFN, WIDTH)
        linear(f"blk.{layer}.ffn_up.weight", FFN, WIDTH)
        linear(f"blk.{layer}.ffn_down.weight", WIDTH, FFN)
    norm("output_norm.weight")
    linear("output.weight", vocab, WIDTH)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

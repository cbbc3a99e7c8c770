"""A tiny random Llama (or Qwen2) as a GGUF file, written with the `gguf` package: the real SmolLM2 file's tokenizer
(its `tokenizer.*` fields copied), two layers of width 64, the linear layers in Q8_0 blocks (or in the types
given, K-quants at width 256: their blocks hold 256 values). A few MB, converted in seconds, where the real 135M
file takes tens of seconds. Types gguf-py cannot quantize to (the K-quants) are written as random blocks of
plausible scales: a valid file of that type, its values whatever they decode to."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


def make_tiny_gguf(out: Path, source: Path | None, seed: int = 0, arch: str = "llama", width: int = WIDTH,
                   ffn: int = FFN, kinds: dict[str, str] | None = None) -> Path:
    """kinds: a linear tensor's role (attn_q, ffn_down, output, token_embd ...) -> its GGUF type; "*" for the
    others (default Q8_0). source None: a byte-level tokenizer of 257 tokens instead of SmolLM2's (the file
    then reads, converts and loads in about a second)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import quantize

    kinds = {"*": "Q8_0", **(kinds or {})}
    WIDTH, FFN = width, ffn  # noqa: N806 (the module's constants, for this file)
    reader = GGUFReader(source) if source is not None else None
    writer = GGUFWriter(out, arch)
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
    for name, field in (reader.fields.items() if reader is not None else ()):
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
        array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if array else None)
    if reader is None:
        vocab = _byte_tokenizer(writer)
    writer.add_vocab_size(vocab)

    rng = np.random.default_rng(seed)

    def linear(name: str, rows: int, cols: int) -> None:  # (out, in) as numpy holds it
        kind = kinds.get(name.split(".")[-2], kinds["*"])
        qtype = GGMLQuantizationType[kind]
        weights = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        if kind in ("F32", "F16"):
            writer.add_tensor(name, weights.astype(np.float16 if kind == "F16" else np.float32))
        elif kind in ("Q4_K", "Q6_K"):
            writer.add_tensor(name, _random_k_blocks(kind, rows, cols, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)

    def bias(name: str, rows: int) -> None:
        writer.add_tensor(name, (0.1 * rng.standard_normal(rows)).astype(np.float32))

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(WIDTH)).astype(np.float32))

    linear("token_embd.weight", vocab, WIDTH)
    head_dim = WIDTH // HEADS
    for layer in range(LAYERS):
        norm(f"blk.{layer}.attn_norm.weight")
        linear(f"blk.{layer}.attn_q.weight", WIDTH, WIDTH)
        linear(f"blk.{layer}.attn_k.weight", KV_HEADS * head_dim, WIDTH)
        linear(f"blk.{layer}.attn_v.weight", KV_HEADS * head_dim, WIDTH)
        if arch == "qwen2":  # biases on q, k and v
            bias(f"blk.{layer}.attn_q.bias", WIDTH)
            bias(f"blk.{layer}.attn_k.bias", KV_HEADS * head_dim)
            bias(f"blk.{layer}.attn_v.bias", KV_HEADS * head_dim)
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


def _random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K or Q6_K blocks [rows, bytes] whose values come out about 0.1-0.2 in size."""
    from gguf.quants import Q4_K, Q6_K

    nb = cols // 256
    size = (Q4_K if kind == "Q4_K" else Q6_K).type_size
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)

    def fp16(value: float) -> np.ndarray:
        return (value * rng.uniform(0.5, 1.5, (rows, nb))).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)

    if kind == "Q4_K":  # w = d sc q - dmin mn: sc, mn ~ 32, q ~ 7.5
        raw[..., 0:2], raw[..., 2:4] = fp16(5e-4), fp16(3.75e-3)
    else:  # w = d sc (q - 32), sc small
        raw[..., 192:208] = rng.integers(-8, 9, (rows, nb, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = fp16(1e-3)
    return raw.reshape(rows, -1)


def _byte_tokenizer(writer: object) -> int:
    """GPT-2's byte-level alphabet (256 tokens, one merge) and an end-of-text token: a tokenizer transformers
    converts from GGUF fields in milliseconds. Returns the vocabulary's size."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    alphabet = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens = [*alphabet, "ab", "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    return len(tokens)

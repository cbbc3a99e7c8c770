"""How far --quantization int8 (or gguf) is from the exact path: perplexity over a fixed text, and greedy agreement.

    python tools/quant_quality.py MODEL_DIR [TEXT_FILE] [--tokens 4096] [--quantization int8|gguf]

The model in float32 through Hugging Face's modules, then the same model with its linear layers swapped for the
engine's own int8 layers (engine/quant.py: every nn.Linear but the output head, as `bulkgen run --quantization
int8` runs them), or (gguf: MODEL_DIR converted from a GGUF file) loaded from the file's own blocks
(engine/gguf_load.py, as `--quantization gguf` runs them) against the same file dequantized. Perplexity over the
text's first --tokens tokens in windows of 512; greedy agreement: 16 continuations of 32 tokens from prompts cut
from the text, the share of tokens equal to the float32 model's before the first difference, and how many
continuations are identical. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bulkgen.engine.blocks import GGUFLinear
from bulkgen.engine.cpu.kernels import load_cpu_kernels
from bulkgen.engine.gguf_load import load_gguf
from bulkgen.engine.quant import quantize_linears
from bulkgen.gguf_info import gguf_info

WINDOW = 512


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start:start + WINDOW + 1][None]
        logits = model(window[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum")
        total, count = total + loss.item(), count + window.shape[1] - 1
    return math.exp(total / count)


def continuations(model: torch.nn.Module, prompts: list[torch.Tensor]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        generated = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=32,
                                   min_new_tokens=32, do_sample=False)
        out.append(generated[0, len(prompt):].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("text", nargs="?", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--quantization", choices=("int8", "gguf"), default="int8")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with open(args.text) as f:
        ids = torch.tensor(tokenizer(f.read())["input_ids"][:args.tokens])
    prompts = [ids[i * 200:i * 200 + 64] for i in range(16)]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.inference_mode():
        exact_ppl, exact = perplexity(model, ids), continuations(model, prompts)
        if args.quantization == "int8":
            swapped = quantize_linears(model, load_cpu_kernels())
        else:
            model = load_gguf(gguf_info(Path(args.model)).gguf, Path(args.model), torch.float32, load_cpu_kernels())
            model.set_attn_implementation("sdpa")
            swapped = sum(isinstance(m, GGUFLinear) for m in model.modules())
        int8_ppl, int8 = perplexity(model, ids), continuations(model, prompts)
    pairs = list(zip(exact, int8, strict=True))
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x)) for x, y in pairs]
    print(json.dumps({"model": args.model, "text": args.text, "tokens": len(ids), "layers_quantized": swapped,
                      "quantization": args.quantization,
                      "perplexity_float32": round(exact_ppl, 4), f"perplexity_{args.quantization}": round(int8_ppl, 4),
                      "perplexity_change_pct": round(100 * (int8_ppl / exact_ppl - 1), 2),
                      "greedy_tokens_equal_before_first_difference_pct":
                          round(100 * sum(prefix) / sum(map(len, exact)), 1),
                      "greedy_continuations_identical": f"{sum(x == y for x, y in pairs)}/{len(pairs)}"}))


if __name__ == "__main__":
    main()

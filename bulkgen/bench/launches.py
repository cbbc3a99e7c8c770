"""Kernel launches of one decode step on the Triton path (a GPU's eager step, before CUDA graphs fold it into one):
each Triton kernel launched, and each torch op that computes (a view launches nothing). Counted while the step
runs, on any machine: in Triton's interpreter on a CPU the launches are the same calls a GPU gets.

    python -m bulkgen.bench.launches [--layers 32] [--batch 8]

prints the counts of a decode step of a Llama of that depth (Llama-3.1-8B: 32 layers) and where they come from.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bulkgen.bench.suite import NullTokenizer
from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine

# torch ops that only describe a tensor anew (no kernel on a GPU)
VIEWS = {"view", "_unsafe_view", "reshape", "as_strided", "t", "transpose", "permute", "slice", "select", "unsqueeze",
         "squeeze", "expand", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "chunk", "lift_fresh",
         "empty", "empty_like", "empty_strided", "new_empty", "_reshape_alias", "unfold", "diagonal", "view_as"}


class _TorchOps(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        result = func(*args, **(kwargs or {}))
        # an op that hands back one of its inputs' memory, not in place (a contiguous or .to that had nothing to do)
        inputs = {_pointer(a) for a in args if isinstance(a, torch.Tensor)}
        aliased = isinstance(result, torch.Tensor) and _pointer(result) in inputs - {None} and not name.endswith("_")
        if name not in VIEWS and not aliased:
            self.counts[f"torch.{name}"] += 1
        return result


def _pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # a tensor without storage (a packed weight)
        return None


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter]:
    """Counts the launches made inside: 'triton.<kernel>' and 'torch.<op>' keys."""
    from bulkgen.engine.gpu import attention, ops  # here: triton is optional

    counts: collections.Counter = collections.Counter()
    patched = []
    for module in (attention, ops):
        for name, kernel in vars(module).items():
            if name.endswith("_kernel") and hasattr(kernel, "fn"):
                patched.append((module, name, kernel))
                setattr(module, name, _Counted(kernel, name, counts))
    try:
        with _TorchOps(counts):
            yield counts
    finally:
        for module, name, kernel in patched:
            setattr(module, name, kernel)


class _Counted:
    def __init__(self, kernel: Any, name: str, counts: collections.Counter) -> None:
        self.kernel, self.name, self.counts, self.fn = kernel, name, counts, kernel.fn

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.counts[f"triton.{self.name}"] += 1
            # the kernel's own tensor work (the interpreter's) is not a launch
            with torch.utils._python_dispatch._disable_current_modes():
                return launch(*args, **kwargs)
        return run


def decode_step_launches(engine: Any, batch: int) -> collections.Counter:
    """The launches of one engine step (the model, the sampler, the step's host-to-device copy) that decodes `batch`
    sequences (prompts of 20 tokens, prefilled first)."""
    for i in range(batch):
        engine.add(i, [5 + i] * 20, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    assert len(engine.scheduler.running) == batch, "every sequence decodes in the counted step"
    with counting() as counts:
        engine.step()
    return counts


def small_engine(num_layers: int, device: str) -> Any:
    """A Triton-path engine on a narrow random Llama of num_layers layers: launches depend on depth, not width."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    return Engine(model, EngineConfig(attention_backend="triton", device=device, dtype="float32", block_size=16,
                                      kv_cache_memory=2**22), tokenizer=NullTokenizer())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    engine = small_engine(args.layers, "cuda" if torch.cuda.is_available() else "cpu")
    counts = decode_step_launches(engine, args.batch)
    total = sum(counts.values())
    print(f"a decode step of {args.batch} sequences, {args.layers} layers: {total} launches "
          f"({total / args.layers:.1f} a layer)")
    for name, n in counts.most_common():
        print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()

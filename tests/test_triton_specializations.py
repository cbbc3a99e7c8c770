"""No recompilation after warm-up: the Triton kernels' launches over a ragged run (batch sizes and lengths that
change every step) ask for few variants. Triton compiles one for each combination of a launch's constexprs, its
pointers' 16-byte alignment and, for each int it is not told to leave alone (do_not_specialize), whether it is 1
and whether it divides by 16; a variant is a compile of one or two seconds on a GPU, inside the timed run. Each
launch's key is computed here by that rule (Triton's own, in its JIT's specialization), from what the kernels were
called with while the engine ran in Triton's interpreter."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest
import torch

triton_attention = pytest.importorskip("bulkgen.engine.gpu.attention")

from bulkgen.config import EngineConfig, SamplingParams  # noqa: E402
from bulkgen.engine.engine import Engine  # noqa: E402
from bulkgen.engine.runner import warm_up_seq  # noqa: E402

KERNELS = ("_write_kv_kernel", "_decode_kernel", "_combine_kernel", "_prefill_kernel")


def _key(kernel: object, name: str, args: tuple, kwargs: dict) -> tuple:
    parameters = inspect.signature(kernel.fn).parameters
    bound = dict(zip(parameters, args, strict=False)) | kwargs
    varying = set(triton_attention.VARYING.get(name, ()))
    key = []
    for param, value in bound.items():
        if "constexpr" in str(parameters[param].annotation):
            key.append((param, value))
        elif isinstance(value, torch.Tensor):
            key.append((param, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int) or param in varying:
            key.append((param, type(value).__name__))
        else:
            key.append((param, value == 1, value % 16 == 0))
    return tuple(key)


def test_a_ragged_run_asks_for_few_kernel_variants_and_none_past_the_warm_up(tiny_model_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    keys: dict[str, set] = {name: set() for name in KERNELS}

    class Recorded:
        def __init__(self, kernel: object, name: str) -> None:
            self.kernel, self.name, self.fn = kernel, name, kernel.fn

        def __getitem__(self, grid: object):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                keys[self.name].add(_key(self.kernel, self.name, args, kwargs))
                return launch(*args, **kwargs)
            return run

    for name in KERNELS:
        monkeypatch.setattr(triton_attention, name, Recorded(getattr(triton_attention, name), name))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(2, 70))] for _ in range(8)]
    params = [SamplingParams(max_new_tokens=rng.randint(3, 14), ignore_eos=True) for _ in prompts]
    engine = Engine(tiny_model_dir, EngineConfig(attention_backend="triton", block_size=16, max_num_seqs=6,
                                                 max_num_batched_tokens=40, kv_cache_memory=2 * 2**20))
    # what a GPU's engine runs at start (here, in the interpreter, it is called by hand: nothing compiles)
    runner = engine.runner
    splits = runner.backend.warm_up(runner.execute, warm_up_seq(runner.layout.num_groups), runner.max_model_len)
    assert splits == [1, 2], "the interpreter's split counts: two a sequence at most"
    warmed = {name: set(found) for name, found in keys.items()}
    for found in keys.values():
        found.clear()
    engine.stats.keep_steps = True
    outputs = list(engine.generate(prompts, params))
    assert len(outputs) == len(prompts)
    batches = {step.num_seqs for step in engine.stats.steps}
    assert len(batches) >= 4, "the run was ragged: batches of many sizes"
    # one variant a kernel, but the decode kernel's and the combine's split counts: powers of two (at most 7).
    # Before the sections were aligned and the ints left alone, this run asked for 6 decode and 6 prefill variants
    assert len(keys["_write_kv_kernel"]) == 1 and len(keys["_prefill_kernel"]) == 1, keys
    splits = {entry[1] for key in keys["_decode_kernel"] for entry in key if entry[0] == "NUM_SPLITS"}
    assert all(s & (s - 1) == 0 for s in splits) and len(keys["_decode_kernel"]) == len(splits), keys
    assert len(keys["_combine_kernel"]) <= len(splits)
    # and every one the run asked for was compiled by the warm-up
    assert all(keys[name] <= warmed[name] for name in KERNELS), {name: keys[name] - warmed[name] for name in KERNELS}


def test_a_decode_step_launches_ten_kernels_a_layer_and_copies_no_query() -> None:
    """Launches of one engine decode step on the Triton path (bench/launches.py: each Triton launch, each torch op
    that computes), at two depths: what one more layer costs, and what the step costs besides. A layer: its four
    projections (qkv and gate/up fused), two add+RMSNorms, RoPE, the KV write, decode attention, SiLU-and-multiply;
    no copy of the query (the kernels read the fused projection's rows in place), no prefill launch."""
    from bulkgen.bench.launches import decode_step_launches, small_engine

    counts = {layers: decode_step_launches(small_engine(layers, "cpu"), batch=2) for layers in (1, 2)}
    per_layer = sum(counts[2].values()) - sum(counts[1].values())
    rest = sum(counts[1].values()) - per_layer
    assert per_layer == 10, (counts[2] - counts[1])
    assert rest <= 30, counts[1]
    assert not {"torch.contiguous", "torch.clone", "torch.copy_", "triton._prefill_kernel"} & set(counts[2]), counts[2]


def test_every_kernel_binds_its_arguments_in_tritons_own_binder() -> None:
    """On a GPU each launch goes through a binder Triton generates from the kernel's signature (the interpreter the
    other tests run in skips it). Its generated code has locals of its own (`params`, `specialization`, ...): a
    kernel argument of the same name is shadowed and every launch fails ("failed to specialize argument of type:
    dict"; a kernel argument named `params` did this on an H200). Triton's own generator, called with an int for
    every argument, must bind them all."""
    from triton.runtime.jit import JITFunction, create_function_from_signature

    modules = [triton_attention, pytest.importorskip("bulkgen.engine.gpu.ops")]
    kernels = {f"{m.__name__}.{name}": getattr(value, "fn", value)
               for m in modules for name, value in vars(m).items()
               if type(value).__name__ in ("JITFunction", "InterpretedFunction")}
    assert {f"{triton_attention.__name__}.{k}" for k in KERNELS} <= set(kernels)
    for name, fn in kernels.items():
        jit = JITFunction(fn)
        binder = create_function_from_signature(jit.signature, jit.params, None)
        bound, _, _ = binder(*[1 for _ in jit.params])
        assert bound == {p.name: 1 for p in jit.params}, name

"""On a GPU only (skipped elsewhere; .ci/gpu-check runs it on a lent one): CUDA-graph decode replays the
eager Triton path token for token, and how much faster its decode steps are."""

from __future__ import annotations

import time

import pytest
import torch

from bulkgen.config import EngineConfig, SamplingParams
from bulkgen.engine.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(graphs: bool, model_name: str, dtype: str, num_requests: int) -> tuple[dict, float]:
    from bulkgen.bench.suite import NullTokenizer, build_model

    model = build_model(model_name, getattr(torch, dtype), "cuda")
    engine = Engine(model, EngineConfig(dtype=dtype, device="cuda", cuda_graphs=graphs, max_num_seqs=64,
                                        kv_cache_memory=2 * 2**30), tokenizer=NullTokenizer())
    generator = torch.Generator().manual_seed(0)
    for i in range(num_requests):
        prompt = torch.randint(3, model.config.vocab_size, (int(torch.randint(8, 200, (1,), generator=generator)),),
                               generator=generator).tolist()
        engine.add(i, prompt, SamplingParams(max_new_tokens=48, ignore_eos=True))
    outputs, decode_time = {}, 0.0
    while engine.has_unfinished():
        torch.cuda.synchronize()
        started = time.perf_counter()
        decoding = not engine.scheduler.waiting
        finished = engine.step()
        if decoding:
            decode_time += time.perf_counter() - started
        outputs.update((o.request_id, o.output_token_ids) for o in finished)
    return outputs, decode_time


@pytest.mark.parametrize(("model_name", "dtype"), [("tiny", "float32"), ("smollm2-135m", "float32"),
                                                   ("llama-3.2-1b", "bfloat16")])
def test_graph_replay_equals_eager(model_name: str, dtype: str) -> None:
    _run(True, model_name, dtype, 4)  # compile the Triton kernels once
    eager, eager_s = _run(False, model_name, dtype, 96)
    graphs, graphs_s = _run(True, model_name, dtype, 96)
    same = sum(eager[i] == graphs[i] for i in eager)
    print(f"\n{model_name} {dtype}: {same}/{len(eager)} requests token-identical; decode-only steps "
          f"{eager_s:.3f} s eager, {graphs_s:.3f} s graphs ({eager_s / graphs_s:.2f}x)")
    if dtype == "float32":  # bfloat16 on random weights: a padded batch's GEMM may sum in another order and
        assert same == len(eager)  # flip a near-tie, as in any engine whose batch shape changes

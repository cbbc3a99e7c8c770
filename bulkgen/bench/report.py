"""A bench run's figures: each engine's metrics from its child's raw output, the comparison of tokens with
the reference engine, and the report as a table, a JSON file and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bulkgen.bench.workload import Workload


def metrics(label: str, dtype: str, raw: dict[str, Any], workload: Workload) -> dict[str, Any]:
    wall = raw["wall_s"]
    num_output = sum(len(t) for t in raw["output_token_ids"])
    finish = sorted(raw["finish_s"]) if raw.get("finish_s") else None
    tail = None
    if finish:
        ninety = finish[max(0, int(0.9 * len(finish)) - 1)]
        tail = finish[-1] - ninety
    return {
        "engine": label, "dtype": dtype,
        "output_tok_per_s": num_output / wall,
        "total_tok_per_s": (num_output + workload.num_prompt_tokens) / wall,
        "wall_s": wall, "tail_s": tail,
        "peak_memory_bytes": raw.get("peak_memory_bytes"),
        "preemptions": raw.get("preemptions"),
        # prompt tokens the engine computed (recomputation included, cached prefixes not), against the workload's
        # distinct ones (each shared prefix once: the least a run can compute)
        "prompt_tokens_computed": raw.get("prompt_tokens_computed"),
        "prefill_ratio": raw["prompt_tokens_computed"] / workload.num_distinct_prompt_tokens
        if raw.get("prompt_tokens_computed") is not None else None,
        "mean_batch_occupancy": raw.get("mean_batch_occupancy"),
        # a sequence's engine steps per output token (each step that samples it gives one token and the draft
        # tokens it keeps), and the draft tokens verified and kept (bulkgen: engine/speculate.py)
        "steps_per_token": 1 - raw["accepted_tokens"] / num_output if raw.get("num_steps") and num_output else None,
        "drafted_tokens": raw.get("drafted_tokens"),
        "accepted_tokens": raw.get("accepted_tokens"),
        "padding_fraction": raw.get("padding_fraction"),
        "kv_cache_tokens": raw.get("kv_cache_tokens"),
        "all_budgets_met": [len(t) for t in raw["output_token_ids"]] == workload.max_new_tokens,
        "notes": _json_note(raw) or raw.get("notes") or raw.get("attention"),
        "steps": raw.get("steps"),
        "_tokens": raw["output_token_ids"],
    }


def _json_note(raw: dict[str, Any]) -> str | None:
    if "json_valid" not in raw:
        return None
    valid, complete = raw["json_valid"]
    return f"JSON schema: {valid}/{complete} complete outputs valid"


def compare(results: list[dict[str, Any]], reference_label: str | None = None) -> None:
    """Agreement with the reference (by default the first Hugging Face engine run) and ratios to bulkgen."""
    ok = [r for r in results if not r.get("error")]
    if reference_label:
        reference = next((r for r in ok if r["engine"] == reference_label), None)
    else:
        reference = next((r for r in ok if r["engine"].startswith("hf-")), None)
    base = next((r for r in ok if r["engine"] == "bulkgen"), None)
    for r in ok:
        if reference is not None:
            pairs = zip(r["_tokens"], reference["_tokens"], strict=True)
            r["identical_share"] = sum(a == b for a, b in pairs) / len(reference["_tokens"])
            r["reference"] = reference["engine"]
        else:
            r["identical_share"] = None
        if base is not None:
            r["ratio_vs_bulkgen"] = r["output_tok_per_s"] / base["output_tok_per_s"]
    for r in ok:
        del r["_tokens"]


def format_table(report: dict[str, Any]) -> str:
    w = max([22, *(len(r["engine"]) for r in report["results"])])  # the engine column fits every label
    header = (f"{'engine':<{w}} {'out tok/s':>9} {'total tok/s':>11} {'wall s':>8} {'tail s':>7} {'peak mem':>9} "
              f"{'preempt':>7} {'prefill':>7} {'batch':>6} {'steps/tok':>9} {'pad':>5} {'identical':>9}  notes")
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        if r.get("error"):
            lines.append(f"{r['engine']:<{w}} failed: {r['error'][:80]}")
            continue
        mem = f"{r['peak_memory_bytes'] / 2**30:.2f}G" if r.get("peak_memory_bytes") else "-"
        ident = f"{100 * r['identical_share']:.1f}%" if r.get("identical_share") is not None else "-"
        lines.append(
            f"{r['engine']:<{w}} {r['output_tok_per_s']:>9.1f} {r['total_tok_per_s']:>11.1f} {r['wall_s']:>8.1f} "
            f"{_opt(r['tail_s'], '.1f'):>7} {mem:>9} {_opt(r['preemptions'], 'd'):>7} "
            f"{_opt(r.get('prefill_ratio'), '.2f') + ('x' if r.get('prefill_ratio') is not None else ''):>7} "
            f"{_opt(r['mean_batch_occupancy'], '.1f'):>6} {_opt(r.get('steps_per_token'), '.2f'):>9} "
            f"{_opt(r['padding_fraction'], '.0%'):>5} {ident:>9}  {r.get('notes') or ''}{_drafts(r)}")
    return "\n".join(lines)


def _drafts(r: dict[str, Any]) -> str:
    drafted = r.get("drafted_tokens")
    return f" · drafts {r['accepted_tokens']:,}/{drafted:,} kept" if drafted else ""


def write_json(report: dict[str, Any], path: Path) -> None:
    slim = {**report, "results": [{k: v for k, v in r.items() if k != "steps"} for r in report["results"]]}
    path.write_text(json.dumps(slim, indent=2))


def plot(report: dict[str, Any], path: Path) -> bool:
    """Tokens per step and KV use over time of bulkgen's run. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    run = next((r for r in report["results"] if r["engine"] == "bulkgen" and r.get("steps")), None)
    if run is None:
        return False
    steps = run["steps"]
    t = [s[0] for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(t, [s[1] for s in steps], lw=0.8, label="tokens computed")
    top.plot(t, [s[2] for s in steps], lw=0.8, label="decode tokens")
    top.set_ylabel("tokens per step")
    top.legend(loc="upper right")
    top.set_title(f"bulkgen on {report['workload']['name']}: {run['output_tok_per_s']:.1f} output tok/s, "
                  f"{run['preemptions']} preemptions")
    bottom.plot(t, [100 * s[4] for s in steps], color="tab:red", lw=0.8)
    bottom.set_ylabel("KV blocks in use (%)")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _opt(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)

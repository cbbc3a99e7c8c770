"""The report's plots, from figures.py's data: each a small SVG (text kept as text, no fonts embedded) drawn on
its own matplotlib Figure (no pyplot, no global state). Needs matplotlib: `pip install 'bulkgen[report]'`."""

from __future__ import annotations

import io
from datetime import datetime, timedelta
from typing import Any

from bulkgen.engine.protocol import FinishReason
from bulkgen.errors import ConfigError

WIDTH_IN, HEIGHT_IN = 7.5, 2.8
REASON_COLORS = {FinishReason.STOP: "#4c956c", FinishReason.EOS: "#2c6e49", FinishReason.LENGTH: "#f4a259",
                 FinishReason.ERROR: "#bc4b51"}


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("the report's plots need matplotlib: pip install 'bulkgen[report]' "
                          "(or `bulkgen report --json` for the figures alone)") from exc
    return matplotlib, Figure


def plots(job: dict[str, Any]) -> list[dict[str, str]]:
    """[{name, title, svg, note}] for one job's figures: a plot where there is something to draw."""
    out = []
    for name, title, draw in ((("throughput", "Output tokens per second over time", _throughput)),
                              ("lengths", "Prompt and output lengths", _lengths),
                              ("timing", "Time to first token and latency per request", _timing),
                              ("finish", "How requests ended", _finish),
                              ("engine", "Running sequences and KV cache use over time", _engine)):
        figure = draw(job)
        if figure is not None:
            out.append({"name": name, "title": title, "svg": _svg(figure)})
    return out


def _figure(ncols: int = 1, height_in: float = HEIGHT_IN) -> tuple[Any, Any]:
    _, Figure = _matplotlib()
    figure = Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
    axes = figure.subplots(1, ncols)
    for ax in (axes if ncols > 1 else [axes]):
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(alpha=0.3, linewidth=0.6)
    return figure, axes


def _svg(figure: Any) -> str:
    matplotlib, _ = _matplotlib()
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "font.size": 8}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()


def _when(iso: str) -> datetime:
    return datetime.fromisoformat(iso.rstrip("Z"))


def _time_axis(ax: Any, start: datetime, end: datetime) -> None:
    """Dates on x, concise (HH:MM where a run is one day), the run's whole span shown however short."""
    import matplotlib.dates as mdates

    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    pad = max((end - start) * 0.02, timedelta(seconds=1))
    ax.set_xlim(mdates.date2num(start - pad), mdates.date2num(end + pad))


def _throughput(job: dict[str, Any]) -> Any:
    import matplotlib.dates as mdates

    data = job["throughput"]
    if not data["series"]:
        return None
    figure, ax = _figure()
    workers = [s for s in data["series"] if s["worker_id"] != "all"]
    total = data["series"][-1]
    start, bin_s = _when(data["start"]), data["bin_s"]
    edges = mdates.date2num([start + timedelta(seconds=i * bin_s) for i in range(len(total["output_tok_per_s"]) + 1)])
    if len(workers) > 1:
        for s in workers:
            ax.stairs(s["output_tok_per_s"], edges, linewidth=1, label=_short(s["worker_id"]))
    ax.stairs(total["output_tok_per_s"], edges, linewidth=1.8, color="#1d3557", fill=len(workers) == 1,
              alpha=0.85, label="all workers" if len(workers) > 1 else None)
    for gap in data["gaps"]:
        ax.axvspan(mdates.date2num(_when(gap["from"])), mdates.date2num(_when(gap["to"])), color="#e63946", alpha=0.15)
    if data["gaps"]:
        ax.plot([], [], color="#e63946", alpha=0.3, linewidth=6, label=f"nothing ran ({len(data['gaps'])} gap(s))")
    ax.set_ylabel("output tok/s")
    source = " (from commit times)" if data["source"] == "commits" else ""
    ax.set_xlabel(f"time (UTC), {bin_s} s bins{source}")
    ax.set_ylim(bottom=0)
    _time_axis(ax, start, start + timedelta(seconds=bin_s * len(total["output_tok_per_s"])))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(frameon=False, fontsize=7)
    return figure


def _short(worker_id: str) -> str:
    host, _, rest = worker_id.partition(":")
    return f"{host[:12]}:{rest}"


def _histogram(ax: Any, dist: dict[str, Any], label: str, color: str, upper: float | None = None) -> None:
    from matplotlib.ticker import MaxNLocator

    if not dist.get("count"):
        ax.text(0.5, 0.5, "none yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        return
    edges, counts = dist["histogram"]["edges"], dist["histogram"]["counts"]
    ax.stairs(counts, edges, fill=True, color=color, alpha=0.8)
    if upper is not None:  # output lengths: from nothing to the budget, so that "cut by the budget" shows
        ax.set_xlim(0, max(edges[-1], upper) * 1.04)
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.axvline(dist["p50"], color="#333", linewidth=1, linestyle="--")
    ax.set_xlabel(f"{label} (median {dist['p50']:g}, p90 {dist['p90']:g})")
    ax.set_ylabel("requests")


def _lengths(job: dict[str, Any]) -> Any:
    dists = job["distributions"]
    figure, (left, right) = _figure(2)
    _histogram(left, dists["prompt_tokens"], "prompt tokens", "#457b9d")
    budget = (job["settings"]["sampling"] or {}).get("max_new_tokens")
    budget = budget if isinstance(budget, int) else None  # one budget for every row, or none to mark
    _histogram(right, dists["output_tokens"], "output tokens", "#2a9d8f", upper=budget)
    if budget and dists["output_tokens"].get("count"):
        right.axvline(budget, color="#e76f51", linewidth=1.2, label=f"max_new_tokens {budget}")
        right.legend(frameon=False, fontsize=7)
    return figure


def _timing(job: dict[str, Any]) -> Any:
    dists = job["distributions"]
    if not dists["latency_s"].get("count"):
        return None
    figure, (left, right) = _figure(2)
    _histogram(left, dists["time_to_first_token_s"], "time to first token, s", "#8d99ae")
    _histogram(right, dists["latency_s"], "latency, s", "#6d597a")
    return figure


def _finish(job: dict[str, Any]) -> Any:
    reasons = job["finish_reasons"]
    if not reasons["counts"]:
        return None
    names = list(reasons["counts"])
    figure, ax = _figure(height_in=0.8 + 0.35 * len(names))
    counts = [reasons["counts"][n] for n in names]
    bars = ax.barh(names, counts, color=[REASON_COLORS.get(n, "#999") for n in names])
    for bar, name in zip(bars, names, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {reasons['counts'][name]:,} ({reasons['shares'][name]:.0%})", va="center", fontsize=7)
    ax.set_xlabel("requests")
    ax.invert_yaxis()
    ax.margins(x=0.15)
    return figure


def _engine(job: dict[str, Any]) -> Any:
    import matplotlib.dates as mdates

    engine, rates = job["engine"], job["throughput"]
    if not engine["series"]:
        return None
    figure, (left, right) = _figure(2)
    start, bin_s = _when(rates["start"]), rates["bin_s"]
    num_bins = len(rates["series"][-1]["output_tok_per_s"])
    edges = mdates.date2num([start + timedelta(seconds=i * bin_s) for i in range(num_bins + 1)])
    several = len(engine["series"]) > 1
    for s in engine["series"]:
        label = _short(s["worker_id"]) if several else None
        running = [float("nan") if v is None else v for v in s["mean_running"]]
        kv = [float("nan") if v is None else 100 * v for v in s["max_kv_usage"]]
        left.stairs(running, edges, linewidth=1.2, label=label)
        right.stairs(kv, edges, linewidth=1.2, label=label)
    limits = {(r["settings"] or {}).get("max_num_seqs") for r in job["runs"]} - {None}
    if len(limits) == 1:  # occupancy: how full the batch ran against its limit
        (limit,) = limits
        left.axhline(limit, color="#999", linestyle="--", linewidth=1, label=f"--max-num-seqs {limit}")
        left.legend(frameon=False, fontsize=7)
    left.set_ylabel("running sequences (mean)")
    right.set_ylabel("KV blocks held, % (max)")
    right.set_ylim(0, 105)
    left.set_ylim(bottom=0)
    right.set_title(f"{engine['num_preemptions']:,} preemption(s)", fontsize=8)
    end = start + timedelta(seconds=bin_s * num_bins)
    for ax in (left, right):
        _time_axis(ax, start, end)
    if several:
        left.legend(frameon=False, fontsize=7)
    return figure

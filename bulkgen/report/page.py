"""The report as one self-contained HTML page: the figures, their plots embedded as SVG data (nothing fetched
from anywhere: it opens offline, mailed or copied), tables of failures, runs, settings and sample rows."""

from __future__ import annotations

import base64
import json
from importlib import resources
from typing import Any

import jinja2

from bulkgen.report.plots import plots


def render(report: dict[str, Any], refresh_s: float | None = None) -> str:
    """The page; refresh_s: while served live and some job still runs, the browser reloads it that often."""
    template = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True,
                                  undefined=jinja2.StrictUndefined)
    template.filters["pct"] = lambda v: "-" if v is None else f"{100 * v:.1f}%"
    template.filters["num"] = lambda v: "-" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:,.2f}"
    template.filters["clip"] = lambda v, n=600: "" if v is None else (v if len(v) <= n else v[:n] + " …")
    page = template.from_string(resources.files("bulkgen.report").joinpath("page.html").read_text())
    jobs = [{**job, "plots": [{**p, "src": "data:image/svg+xml;base64," + base64.b64encode(p["svg"].encode()).decode()}
                              for p in plots(job)]} for job in report["jobs"]]
    live = refresh_s if refresh_s and not all(job["is_final"] for job in report["jobs"]) else None
    data = json.dumps(_small(report), default=str).replace("<", "\\u003c")  # no "</script>" inside its script
    return page.render(report=report, jobs=jobs, refresh_s=live, data=data)


def _small(report: dict[str, Any]) -> dict[str, Any]:
    """The summary figures, embedded in the page as JSON (a script can read them off a saved page)."""
    return {"generated_at": report["generated_at"],
            "jobs": [{"id": j["id"], "summary": j["summary"], "finish_reasons": j["finish_reasons"],
                      "json_schema": j["json_schema"]} for j in report["jobs"]]}

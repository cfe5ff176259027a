"""The Grafana dashboard (configs/grafana/ferry.json) without Grafana: its queries
evaluated by a real Prometheus, drawn with matplotlib, one subplot per panel.

tests/integration/test_dashboard.py runs a Prometheus against a Ferry under load
and, with FERRY_DASHBOARD_DUMP=PATH set, saves every panel's range-query results
there; this script draws them:

    FERRY_DASHBOARD_DUMP=/tmp/dash.json python -m pytest tests/integration/test_dashboard.py
    python -m loadtest.render_dashboard /tmp/dash.json configs/grafana/ferry.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "configs" / "grafana" / "ferry.json"


def panels(path: Path = DASHBOARD) -> list[dict[str, Any]]:
    """The dashboard's graph panels (rows left out), in order."""
    dashboard = json.loads(path.read_text())
    return [p for p in dashboard["panels"] if p.get("type") != "row"]


def substitute(expr: str, *, job: str = "ferry", rate_interval: str = "1m") -> str:
    """An expression as Grafana sends it, its variables filled in."""
    return expr.replace("$__rate_interval", rate_interval).replace("$job", job)


def query(prometheus: str, expr: str, **range_: float) -> list[dict[str, Any]]:
    """Evaluate `expr` through Prometheus's HTTP API (an instant query, or a range
    query with start, end and step in seconds); its result series."""
    path = "/api/v1/query_range" if range_ else "/api/v1/query"
    params = urllib.parse.urlencode({"query": expr, **{k: str(v) for k, v in range_.items()}})
    with urllib.request.urlopen(f"{prometheus}{path}?{params}", timeout=10) as resp:
        answer = json.load(resp)
    if answer.get("status") != "success":
        raise ValueError(f"{expr}: {answer}")
    return list(answer["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def render(dump: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = dump["panels"]
    cols = 3
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.2, rows * 2.9), squeeze=False)
    start = dump["start"]
    for ax, panel in zip(axes.flat, shown, strict=False):
        for target in panel["targets"]:
            for series in target["result"]:
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                xs = [p[0] for p in points]
                ys = [p[1] if math.isfinite(p[1]) else math.nan for p in points]
                if not any(ys):  # a series at 0 all along (pre-created): no legend entry
                    continue
                ax.plot(xs, ys, linewidth=1, label=legend(target["legend"], series["metric"]))
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.set_xlabel(f"seconds ({panel['unit']})", fontsize=7)
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize=6, loc="upper left", ncol=2, frameon=False)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle(
        "Ferry dashboard (configs/grafana/ferry.json): its queries on a real Prometheus"
        " scraping Ferry and stand-in engines under load",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=Path, help="the query results test_dashboard.py saved")
    parser.add_argument("out", type=Path, help="the image to write (.png or .svg)")
    args = parser.parse_args()
    render(json.loads(args.dump.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

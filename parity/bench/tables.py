"""``bench.csv`` (one row per model x path x metric x repetition), ``bench.md`` (the
environment first, then per model the metrics of each path and native/legacy ratios) and,
with the ``plot`` extra, PNG plots. Plotting never produces a number."""

from __future__ import annotations

import csv
import os

from parity.report.summary import spread

COLUMNS = ("fixture", "path", "path_taken", "ranks", "device", "metric", "unit", "repetition", "value")
#: The PNG files :func:`plot` writes: collectives and bytes per step, step time.
PLOTS = ("bench_collectives.png", "bench_step_time.png")


def rows_for(fixture: str, path: str, ranks: int, device: str, results) -> list[dict]:
    r0 = results[0]
    base = {"fixture": fixture, "path": path, "path_taken": r0.taken, "ranks": ranks, "device": device}
    rows = [{**base, "metric": "units", "unit": "count", "repetition": 0, "value": r0.units}]
    total_n = total_b = 0
    for (kind, phase), (n, b) in sorted(r0.collectives.items()):
        rows.append({**base, "metric": f"collectives {kind} {phase}", "unit": "count/step", "repetition": 0, "value": n})
        rows.append({**base, "metric": f"bytes {kind} {phase}", "unit": "bytes/step", "repetition": 0, "value": b})
        total_n, total_b = total_n + n, total_b + b
    rows.append({**base, "metric": "collectives total", "unit": "count/step", "repetition": 0, "value": total_n})
    rows.append({**base, "metric": "bytes total", "unit": "bytes/step", "repetition": 0, "value": total_b})
    packing = {}
    for r in results:  # the slowest rank's packing time per op
        for k, v in r.packing_s.items():
            packing[k] = max(packing.get(k, 0.0), v)
    for k, v in sorted(packing.items()):
        rows.append({**base, "metric": f"packing {k}", "unit": "ms/step (profiled)", "repetition": 0, "value": v * 1e3})
    rows.append({**base, "metric": "packing total", "unit": "ms/step (profiled)", "repetition": 0,
                 "value": sum(packing.values()) * 1e3})
    for k, v in r0.memory.items():
        rows.append({**base, "metric": f"memory {k}", "unit": "MiB (rank 0)", "repetition": 0, "value": v})
    steps = [max(r.step_s[i] for r in results) for i in range(len(r0.step_s))]  # synchronized: slowest rank
    for i, t in enumerate(steps):
        rows.append({**base, "metric": "step time", "unit": "ms", "repetition": i, "value": t * 1e3})
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def by_model(rows: list[dict]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """fixture -> path -> metric -> values (over repetitions)."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["fixture"], {}).setdefault(r["path"], {}).setdefault(r["metric"], []).append(float(r["value"]))
    return out


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(rows: list[dict], env: dict[str, str], *, warmup: int, steps: int, failures: list[str],
             fell_back: list[str] = ()) -> str:
    lines = ["# parity bench", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", f"{warmup} warm-up steps, then {steps} measured steps between barriers (step time: median, "
              "IQR, min over them, the slowest rank per step). Collectives, bytes and packing: one further "
              "step (counted where issued; packing from the profiler). Time and memory are meaningful on "
              "GPUs; on this CPU they only order the paths. Counts and bytes are meaningful everywhere.", ""]
    units = {r["metric"]: r["unit"] for r in rows}
    for fixture, paths in by_model(rows).items():
        names = list(paths)
        lines += [f"## {fixture}", ""]
        ratio = "native/legacy" if {"native", "legacy"} <= set(names) else ""
        lines.append("| metric | unit | " + " | ".join(names) + (f" | {ratio} |" if ratio else " |"))
        lines.append("|---|---|" + "---|" * (len(names) + (1 if ratio else 0)))
        metrics = list(dict.fromkeys(m for p in names for m in paths[p]))
        for m in metrics:
            cells, medians = [], {}
            for p in names:
                vals = paths[p].get(m)
                if not vals:
                    cells.append("-")
                    continue
                s = spread(vals)
                medians[p] = s["median"]
                cells.append(_fmt(s["median"]) + (f" (IQR {_fmt(s['iqr'])}, min {_fmt(s['min'])})" if len(vals) > 1 else ""))
            r = ""
            if ratio:
                a, b = medians.get("native"), medians.get("legacy")
                r = f"{a / b:.2f}" if a is not None and b else "-"
            lines.append(f"| {m} | {units[m]} | " + " | ".join(cells) + (f" | {r} |" if ratio else " |"))
        lines.append("")
    if failures:
        lines += ["## Not measured", ""] + [f"- {f}" for f in failures] + [""]
    if fell_back:
        lines += ["## Measured as another path (fell back)", ""] + [f"- {f}" for f in fell_back] + [""]
    return "\n".join(lines)


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """PNG plots (needs matplotlib: ``pip install parity[plot]``); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = by_model(rows)
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{f}\n{p}" for f, ps in data.items() for p in ps]
    counts = [ps[p].get("collectives total", [0])[0] for ps in data.values() for p in ps]
    nbytes = [ps[p].get("bytes total", [0])[0] / 2**20 for ps in data.values() for p in ps]
    axes[0].bar(range(len(labels)), counts)
    axes[0].set_title("collectives per step")
    axes[1].bar(range(len(labels)), nbytes)
    axes[1].set_title("MiB per step")
    for ax in axes:
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    files.append(os.path.join(out_dir, PLOTS[0]))
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.boxplot([ps[p].get("step time", [0]) for ps in data.values() for p in ps])
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=90, fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("step time")
    fig.tight_layout()
    files.append(os.path.join(out_dir, PLOTS[1]))
    fig.savefig(files[-1], dpi=100)
    plt.close(fig)
    return files

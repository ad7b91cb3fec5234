"""Run every benchmark of the project, one after the other, and write a report (run on demand).

    python3 -m pip install -e '.[bench]'        # matplotlib, for the plots
    python3 tests/benchmarks/report.py [--quick] [--out DIR]
    python3 tests/benchmarks/report.py --on-demand    # only the sections of the on-demand runs' JSON files

Runs bench_lease, bench_fanout, bench_primitives and bench_scale in this
order (never two at once: each starts its own PostgreSQL and measures against
floors of its own run), then writes into DIR (default
``tests/benchmarks/results/``):

- ``report.md``: the machine (CPU model and count, PostgreSQL version, date),
  then one table per benchmark with its rows as the benchmark prints them and
  its notes;
- ``ratios_<benchmark>.png``: every row's ratio against its floor (the ratio
  column as printed), with the row's target drawn where it is a ratio;
- ``lock_peers.png``: the lock cycle's throughput ratio of pgbroker and of each
  peer that was installed, side by side, against the same raw floor;
- ``fanout_designs.png``: pgbroker's statement and row modes beside the
  designs users write instead (the fan-out benchmark's comparison variants),
  throughput and CPU per transaction against the same unwatched floor, at 1
  and 8 writers;
- ``latencies.png``: the latency percentiles the benchmarks report (takeover
  after SIGKILL, commit-to-handler, release-to-waiter), pgbroker beside its
  floor.  The benchmarks keep percentiles, not raw samples, so no histogram;
- ``scale.png``: the restart at size against the number of clients: the
  takeover claim beside the empty-state claim, re-registration rates beside
  the floor's, the end-to-end restart, and the steady-state costs.

The report ends with the sections of the benchmarks that are not run here,
from the JSON files they leave in DIR: ``endurance*.json``
(``bench_endurance.py``, 30 minutes each: with data, ``--no-data``,
``--in-memory``), each with its plot (the same name in ``.png``: throughput
per part, pgbroker's size and the broker's memory, minute by minute), and
``installs.json`` (``bench_installs.py``: the same calls on a superuser, a
least-privilege and an earlier revision's install), ``churn.json``
(``bench_churn.py``: client churn at size, issue 45) and ``filters.json``
(``bench_filters.py``: subscriptions by filter, issue 43).  ``--on-demand``
rewrites only those sections of an existing ``report.md``, running nothing.

The ratios carry the claims; absolute times move with the machine's load.
``--quick`` shortens the fan-out, primitives and scale runs (noisier; the scale
benchmark stops at 30k clients); the lease benchmark has no quick mode.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_OUT = REPO / "tests" / "benchmarks" / "results"
ENDURANCE_FILE = "endurance.json"  # written by bench_endurance.py (endurance_no_data.json with --no-data)
INSTALLS_FILE = "installs.json"  # written by bench_installs.py
CHURN_FILE = "churn.json"  # written by bench_churn.py
FILTERS_FILE = "filters.json"  # written by bench_filters.py
ON_DEMAND_HEADINGS = ("## Endurance", "## Installs", "## Churn", "## Filters")  # what write_on_demand rewrites
INSTALL_HINT = "matplotlib is needed for the plots: python3 -m pip install -e '.[bench]' (or: pip install matplotlib)"

RATIO_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)x\s*$")
TARGET_RE = re.compile(r"(<=|>=)\s*(\d+(?:\.\d+)?)x")
MS_RE = re.compile(r"^\s*(\d+(?:\.\d+)?) ms\s*$")
PCT_RE = re.compile(r"(p\d+|max) (\d+(?:\.\d+)?) ms")
LOCK_RE = re.compile(r"^(?:lock acquire\+release, (?P<ours>.+)|peer (?P<peer>.+), lock cycles), (?P<procs>\d+) proc$")
DESIGN_RE = re.compile(r"^(?P<what>UPDATE tps|CPU per transaction), (?P<writers>\d+) writers?: (?P<design>.+)$")


class BenchResults(Protocol):
    rows: list[tuple[str, str, str, str, str]]
    figures: dict[str, float]


@dataclass
class Section:
    """One benchmark's outcome: its Results, or the error that stopped it."""

    name: str  # "lease", "fanout", "primitives"
    title: str
    results: BenchResults | None = None
    error: str = ""
    seconds: float = 0.0
    settings: str = ""

    @property
    def notes(self) -> list[str]:
        return list(getattr(self.results, "notes", []) or [])


@dataclass
class Machine:
    cpu_model: str
    cpus: int
    postgres: str
    date: str
    python: str = field(default_factory=platform.python_version)
    load: str = ""


# ---------------------------------------------------------------------------
# The machine


def machine_info() -> Machine:
    model, count = "unknown", 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "processor":
                count += 1
            elif key.strip() == "model name":
                model = value.strip()
    except OSError:
        pass
    return Machine(
        cpu_model=model,
        cpus=count or os.cpu_count() or 0,
        postgres=postgres_version(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        load="{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
    )


def postgres_version() -> str:
    """The version of the binaries the benchmarks start (pgbroker._embedded.find_pg_bin)."""
    try:
        sys.path.insert(0, str(REPO))
        from pgbroker._embedded import find_pg_bin

        out = subprocess.run([str(find_pg_bin() / "postgres"), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or out.stderr.strip() or "unknown"
    except Exception as exc:  # the report still says what it could not find
        return f"unknown ({exc})"


# ---------------------------------------------------------------------------
# Running the benchmarks


def run_all(quick: bool) -> list[Section]:
    """Run the three benchmarks one after the other, in this process; a failure is recorded, not raised."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import bench_fanout
    import bench_lease
    import bench_primitives
    import bench_scale

    plans: list[tuple[str, str, Callable[[], Any], str]] = [
        ("lease", "Broker lease (bench_lease.py)", bench_lease.run, "full (no quick mode)"),
        (
            "fanout",
            "Fan-out (bench_fanout.py)",
            lambda: bench_fanout.run(bench_fanout.Settings.quick() if quick else bench_fanout.Settings()),
            "--quick" if quick else "full",
        ),
        (
            "primitives",
            "Primitives and peers (bench_primitives.py)",
            lambda: bench_primitives.run(bench_primitives.Settings.quick() if quick else bench_primitives.Settings()),
            "--quick" if quick else "full",
        ),
        (
            "scale",
            "Restart at size (bench_scale.py)",
            lambda: bench_scale.run((1_000, 10_000, 30_000), quick=True) if quick else bench_scale.run(),
            "--quick" if quick else "full",
        ),
    ]
    sections = []
    for name, title, run, settings in plans:
        print(f"== {title}, {settings}", flush=True)
        section = Section(name, title, settings=settings)
        started = time.monotonic()
        try:
            section.results = run()
        except Exception:
            section.error = traceback.format_exc()
            print(section.error, file=sys.stderr, flush=True)
        section.seconds = time.monotonic() - started
        sections.append(section)
    return sections


# ---------------------------------------------------------------------------
# Markdown


def _cell(text: str) -> str:
    text = text.replace("|", "\\|")
    stripped = text.lstrip(" ")
    indent = (len(text) - len(stripped)) // 2
    return "&emsp;" * indent + stripped


def markdown_table(rows: Sequence[tuple[str, str, str, str, str]]) -> str:
    lines = ["| metric | pgbroker | floor | ratio | target |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(
    machine: Machine, sections: Sequence[Section], plots: Sequence[Path], skipped: Sequence[str]
) -> str:
    out = [
        "# pgbroker benchmark report",
        "",
        "Made by `python3 tests/benchmarks/report.py` on:",
        "",
        f"- CPU: {machine.cpu_model}, {machine.cpus} CPUs",
        f"- PostgreSQL: {machine.postgres} (each benchmark starts its own server with fsync,"
        " synchronous_commit and full_page_writes on)",
        f"- Python {machine.python}; date {machine.date}; load average at the start {machine.load}",
        "- runs: " + "; ".join(f"{s.name} {s.settings or '?'}" for s in sections) + " (--quick: shorter, noisier)",
        "",
        "Each ratio compares pgbroker with a floor measured in the same run (rounds alternate);"
        " what a ratio divides is said by each benchmark's footer line below. Absolute figures"
        " move with the machine's load, the ratios much less: the ratios carry the claims.",
        "",
    ]
    footers = {
        "lease": "ratio: pgbroker's time per operation / the floor's (lower is better).",
        "fanout": "floor: the same work unwatched, or the plain SQL named in the metric; the target says"
        " which direction is better for each row.",
        "primitives": "ratio: pgbroker's throughput / the floor's (higher is better), except the latency"
        " rows (p99 / the floor's p99); CPU = client + server.",
        "scale": "ratio: pgbroker's time (or cost) / the floor's (lower is better); the steady-state rows compare"
        " each size with the smallest.",
    }
    for section in sections:
        out += [f"## {section.title}", ""]
        if section.results is None:
            out += ["Failed; no figures:", "", "```", section.error.strip(), "```", ""]
            continue
        out += [markdown_table(section.results.rows), ""]
        missed = [r[0].strip() for r in section.results.rows if r[4].rstrip().endswith("MISSED")]
        out += [
            f"{footers.get(section.name, '')} Run: {section.settings}, {section.seconds:.0f} s;"
            f" targets missed: {'; '.join(missed) or 'none'}.",
            "",
        ]
        out += [f"- note: {n}" for n in section.notes]
        if section.notes:
            out.append("")
    if plots or skipped:
        out += ["## Plots", ""]
        for p in plots:
            out += [f"![{p.stem}]({p.name})", ""]
        out += [f"- {s}" for s in skipped]
        if skipped:
            out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Plots


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _leading_digit(v: float) -> str:
    """'2' for 0.2, 2 and 20: which minor ticks of a log axis get a label."""
    return f"{v:g}".lstrip("0.")[:1]


def ratio_rows(rows: Sequence[tuple[str, str, str, str, str]]) -> list[tuple[str, float, float | None, str, str]]:
    """Each row with an 'Nx' ratio: (metric, ratio, target ratio or None, '<=' / '>=' or '', verdict)."""
    found = []
    for metric, _ours, _floor, ratio, target in rows:
        m = RATIO_RE.match(ratio)
        if not m:
            continue
        t = TARGET_RE.search(target)
        verdict = "MISSED" if target.rstrip().endswith("MISSED") else ("ok" if target.rstrip().endswith("ok") else "")
        found.append((metric.strip(), float(m.group(1)), float(t.group(2)) if t else None, t.group(1) if t else "",
                      verdict))  # fmt: skip
    return found


def plot_ratios(section: Section, out: Path) -> Path | None:
    plt = _matplotlib()
    assert section.results is not None
    data = ratio_rows(section.results.rows)
    if not data:
        return None
    colours = {"ok": "tab:green", "MISSED": "tab:red", "": "tab:gray"}
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.34 * len(data)))
    ys = list(range(len(data)))[::-1]
    # Green / red only where the target is a ratio: a target in ms or per row is not what the bar shows.
    ratios = [d[1] for d in data]
    # Bars grow from the floor (1) on a log scale: below the floor to the left, above to the right, and an
    # outlier (a latency ratio of 100x) leaves the rows near 1 readable.
    ax.barh(ys, [r - 1 for r in ratios], left=1, height=0.65,
            color=[colours[d[4] if d[2] is not None else ""] for d in data])  # fmt: skip
    for y, (_metric, ratio, target, direction, _verdict) in zip(ys, data, strict=True):
        ax.text(ratio, y, f" {ratio:.2f}x " if ratio >= 1 else f" {ratio:.2f}x ", va="center", fontsize=7,
                ha="left" if ratio >= 1 else "right")  # fmt: skip
        if target is not None:
            ax.plot([target, target], [y - 0.4, y + 0.4], color="black", linewidth=2)
            ax.text(target, y + 0.42, f"{direction} {target:g}x", ha="center", va="bottom", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x" if _leading_digit(v) in "25" else ""))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([d[0] for d in data], fontsize=7)
    ax.set_xlabel(
        "ratio to the floor of the same run, as printed (log scale, 1x = the floor; black tick: a ratio target,"
        " green met, red missed; grey: no ratio target)"
    )
    ax.set_title(section.title, fontsize=10)
    low = min([*ratios, *(d[2] for d in data if d[2] is not None), 1.0])
    high = max([*ratios, *(d[2] for d in data if d[2] is not None), 1.0])
    ax.set_xlim(low / 1.6, high * 1.6)
    fig.tight_layout()
    path = out / f"ratios_{section.name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_lock_peers(sections: Sequence[Section], out: Path) -> Path | None:
    """pgbroker's lock cycles beside each installed peer's, each as a throughput ratio to the same raw floor."""
    rows = [r for s in sections if s.name == "primitives" and s.results is not None for r in s.results.rows]
    groups: dict[str, dict[int, float]] = {}
    for metric, _ours, _floor, ratio, _target in rows:
        m, r = LOCK_RE.match(metric.strip()), RATIO_RE.match(ratio)
        if m and r:
            label = f"pgbroker, {m['ours']}" if m["ours"] else m["peer"]
            groups.setdefault(label, {})[int(m["procs"])] = float(r.group(1))
    if not groups:
        return None
    plt = _matplotlib()
    procs = sorted({p for g in groups.values() for p in g})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(groups)
    for i, (label, values) in enumerate(groups.items()):
        xs = [j + i * width for j, p in enumerate(procs) if p in values]
        vs = [values[p] for p in procs if p in values]
        bars = ax.bar(xs, vs, width=width, label=label)
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in vs], fontsize=7)
    ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(procs))])
    ax.set_xticklabels([f"{p} process{'es' if p > 1 else ''}" for p in procs])
    ax.set_ylabel("lock cycles/s / raw advisory-lock floor's")
    ax.set_title("Lock acquire+release: pgbroker and peers against the same floor (higher is better)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "lock_peers.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def design_rows(sections: Sequence[Section]) -> dict[str, dict[str, dict[int, float]]]:
    """The fan-out benchmark's designs side by side: {"UPDATE tps" | "CPU per transaction": {design: {writers:
    ratio to unwatched}}}, in the order the benchmark printed them."""
    found: dict[str, dict[str, dict[int, float]]] = {"UPDATE tps": {}, "CPU per transaction": {}}
    rows = [r for s in sections if s.name == "fanout" and s.results is not None for r in s.results.rows]
    for metric, _ours, _floor, ratio, _target in rows:
        m, r = DESIGN_RE.match(metric.strip()), RATIO_RE.match(ratio)
        if m and r:
            found[m["what"]].setdefault(m["design"], {})[int(m["writers"])] = float(r.group(1))
    return found


def plot_designs(sections: Sequence[Section], out: Path) -> Path | None:
    """pgbroker's two modes beside the designs users write instead, against the same unwatched floor."""
    data = design_rows(sections)
    if not data["UPDATE tps"]:
        return None
    plt = _matplotlib()
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.9 + 0.55 * len(data["UPDATE tps"])), sharey=True)
    titles = {
        "UPDATE tps": "throughput / unwatched (higher is better)",
        "CPU per transaction": "CPU per transaction / unwatched (lower is better)",
    }
    designs = list(data["UPDATE tps"])
    ys = list(range(len(designs)))[::-1]
    for ax, (what, per_design) in zip(axes, data.items(), strict=True):
        writers = sorted({w for d in per_design.values() for w in d})
        h = 0.8 / max(len(writers), 1)
        for i, w in enumerate(writers):
            vs = [per_design.get(d, {}).get(w, 0.0) for d in designs]
            pos = [y + 0.4 - h * (i + 0.5) for y in ys]
            bars = ax.barh(pos, vs, height=h, label=f"{w} writer{'s' if w > 1 else ''}")
            ax.bar_label(bars, labels=[f" {v:.2f}x" for v in vs], fontsize=7)
        ax.axvline(1.0, color="black", linestyle=":", linewidth=1)
        ax.set_title(titles[what], fontsize=9)
        ax.set_xlim(0, max([1.0, *(v for d in per_design.values() for v in d.values())]) * 1.25)
        ax.legend(fontsize=7)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(designs, fontsize=7)
    fig.suptitle("Single-row UPDATEs of a watched table: pgbroker's modes beside the designs users write instead"
                 " (same run, each with its consumer)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path = out / "fanout_designs.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def latency_rows(sections: Sequence[Section]) -> list[tuple[str, float, float]]:
    """(label, pgbroker ms, floor ms) for each latency percentile a benchmark printed."""
    found = []
    for section in sections:
        if section.results is None:
            continue
        for metric, ours, floor, _ratio, _target in section.results.rows:
            a, b = MS_RE.match(ours), MS_RE.match(floor)
            if a and b:
                found.append((metric.strip(), float(a.group(1)), float(b.group(1))))
                continue
            pa, pb = dict(PCT_RE.findall(ours)), dict(PCT_RE.findall(floor))
            for q in pa:
                if q in pb:
                    found.append((f"{metric.strip()} {q}", float(pa[q]), float(pb[q])))
    return [f for f in found if "latency" in f[0] or "takeover" in f[0] or "waiter" in f[0]]


def plot_latencies(sections: Sequence[Section], out: Path) -> Path | None:
    data = latency_rows(sections)
    if not data:
        return None
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.42 * len(data)))
    ys = list(range(len(data)))[::-1]
    h = 0.38
    ax.barh([y + h / 2 for y in ys], [d[1] for d in data], height=h, label="pgbroker", color="tab:blue")
    ax.barh([y - h / 2 for y in ys], [d[2] for d in data], height=h, label="floor", color="tab:gray")
    for y, (_label, a, b) in zip(ys, data, strict=True):
        ax.text(a, y + h / 2, f" {a:.2f} ms", va="center", fontsize=6)
        ax.text(b, y - h / 2, f" {b:.2f} ms", va="center", fontsize=6)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if _leading_digit(v) in "25" else ""))
    ax.set_yticks(ys)
    ax.set_yticklabels([d[0] for d in data], fontsize=7)
    ax.set_xlabel("milliseconds (log scale); percentiles as the benchmarks report them")
    ax.set_title("Latencies: pgbroker beside the floor of the same run", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "latencies.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_scale(sections: Sequence[Section], out: Path) -> Path | None:
    """The restart at size against the number of clients, one panel per question."""
    series = next((getattr(s.results, "series", None) for s in sections if s.name == "scale" and s.results), None)
    if not series:
        return None
    plt = _matplotlib()
    panels = [
        ("Takeover claim after SIGKILL (ms)", ["takeover claim (ms)", "empty-state claim (ms)"]),
        ("Re-registration (subscriptions/s)",
         ["batched, SQL arrays (subs/s)", "batched, Broker.*_many (subs/s)", "floor INSERT ... SELECT (rows/s)"]),
        ("SIGKILL to every client re-subscribed and served (s)", ["end to end (s)"]),
        ("Steady state (server backend CPU, us)",
         ["watched single-row UPDATE, backend CPU (us)", "fetch per delivered row, backend CPU (us)"]),
    ]  # fmt: skip
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, names) in zip(axes.flat, panels, strict=True):
        for name in names:
            points = sorted(series.get(name, {}).items())
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("clients (x 10 subscriptions)")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
    fig.suptitle("Restart at size: what a takeover and a reconnect cost as the old broker's state grows", fontsize=10)
    fig.tight_layout()
    path = out / "scale.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def render_plots(sections: Sequence[Section], out: Path) -> tuple[list[Path], list[str]]:
    """Write the PNGs; returns (paths, notes on what was skipped and why)."""
    plots: list[Path] = []
    skipped: list[str] = []
    for section in sections:
        if section.results is None:
            skipped.append(f"no ratio plot for {section.title}: the benchmark failed")
            continue
        path = plot_ratios(section, out)
        if path is None:
            skipped.append(f"no ratio plot for {section.title}: no row has a ratio")
        else:
            plots.append(path)
    path = plot_lock_peers(sections, out)
    if path is None:
        skipped.append("no lock-peers plot: no lock-cycle rows (the primitives benchmark did not run)")
    else:
        plots.append(path)
    path = plot_designs(sections, out)
    if path is None:
        skipped.append("no design comparison plot: no throughput rows (the fan-out benchmark's first part did not run)")
    else:
        plots.append(path)
    path = plot_latencies(sections, out)
    if path is None:
        skipped.append("no latency plot: no latency rows")
    else:
        plots.append(path)
    path = plot_scale(sections, out)
    if path is None:
        skipped.append("no scale plot: the scale benchmark did not run")
    else:
        plots.append(path)
    skipped.append(
        "no latency histograms: the benchmarks keep percentiles (p50/p95/p99/max), not raw samples,"
        " in their Results; the latency plot shows those percentiles"
    )
    return plots, skipped


# ---------------------------------------------------------------------------
# The on-demand runs: their JSON files, written by bench_endurance.py and bench_installs.py (not part of run_all)


def _load(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text())


def load_endurance(out: Path) -> list[tuple[str, dict[str, Any]]]:
    """The endurance runs recorded in out/endurance*.json (with data first): (file stem, data)."""
    paths = sorted(out.glob("endurance*.json"), key=lambda p: (p.name != ENDURANCE_FILE, p.name))
    return [(p.stem, _load(p)) for p in paths]


def endurance_markdown(data: dict[str, Any], plot: Path | None) -> str:
    """An endurance section: settings, the targets, and per minute the figures bench_endurance.py records."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import bench_endurance

    st = data["settings"]
    parts = sorted({k for m in data["minutes"] for k in m["rates"]})
    when = ""
    if "started" in data:
        when = f" Run {data['started']}" + (f" at commit {data['commit']}" if "commit" in data else "")
        when += f", load average {data['load_start'][0]:.2f} at the start"
        when += f" and {data['load_end'][0]:.2f} at the end." if "load_end" in data else "."
    out = [
        "## Endurance (bench_endurance.py"
        + ("" if st["data"] else " --no-data")
        + (" --in-memory" if st.get("in_memory") else "")
        + ")",
        "",
        f"{st['minutes']} minute(s) on PostgreSQL {data.get('server', '?')}: {st['writers']} writers on a watched"
        f" table, a Python Broker draining {st['clients']:,} clients x {st['per_client']} subscriptions with"
        f" {st['churn_per_s']} churns/s, and locks, {'kv_set, counter_add, ' if st['data'] else ''}rate limits on"
        f" names drawn from {st['names']:,}"
        + (", every one of which had its KV entry and counter before the start" if st.get("prefilled") else "")
        + "; the upkeep only as the Broker runs it."
        + (
            f" The server's files on a tmpfs ({bench_endurance.IN_MEMORY}): its fsyncs return at once, so the"
            " throughput is what the CPU allows."
            if st.get("in_memory")
            else ""
        )  # fmt: skip
        + when
        + (
            " Shorter than 20 minutes, the targets compare the last third with the first and are only indicative."
            if len(data["minutes"]) < 20
            else ""
        ),
        "",
        "| target | value | limit | verdict |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {v['target']} | {v['value']:.3f} | {'-' if v['limit'] is None else v['limit']} |"
        f" {'shown' if v['ok'] is None else 'ok' if v['ok'] else 'MISSED'} |"
        for v in bench_endurance.verdicts(data["minutes"], st["data"])
    ]
    out += ["", "| minute | " + " | ".join(f"{p}/s" for p in parts) + " | pgbroker MB | largest tables (MB) |"
            " dead tuples | outbox | WAL MB, ms per fsync | server CPU ms/op | broker RSS MB | upkeep removed / left |",
            "|" + "---|" * (len(parts) + 9)]  # fmt: skip
    previous: dict[str, Any] = {}
    for m in data["minutes"]:
        cpu = bench_endurance.cpu_ms_per_op([m], previous) if previous else None
        wal = "-"
        if "wal_bytes" in m and "wal_bytes" in previous:
            wal = f"{(m['wal_bytes'] - previous['wal_bytes']) / 1e6:,.0f}"
            if m.get("wal_syncs", 0) > previous.get("wal_syncs", 0):
                wal += (
                    f", {(m['wal_sync_ms'] - previous['wal_sync_ms']) / (m['wal_syncs'] - previous['wal_syncs']):.2f}"
                )
        previous = m
        tables = sorted(m["tables"].items(), key=lambda kv: -kv[1]["bytes"])[:3]
        upkeep = m.get("upkeep", {})
        out.append(
            f"| {m['minute']} | "
            + " | ".join(f"{m['rates'].get(p, 0):,.0f}" for p in parts)
            + f" | {m['pgbroker_bytes'] / 1e6:.1f} | "
            + ", ".join(f"{name} {t['bytes'] / 1e6:.1f}" for name, t in tables)
            + f" | {sum(t['dead'] for t in m['tables'].values()):,} | {m['outbox_backlog']:,} | {wal}"
            f" | {'-' if cpu is None else f'{cpu:.2f}'} | {m['broker_rss_kb'] / 1024:.0f} | "
            + f"{sum(u['removed_total'] for u in upkeep.values()):,} / {sum(u['remaining'] for u in upkeep.values()):,}"
            + " |"
        )
    indexed = [m for m in data["minutes"] if "outbox_index_bytes" in m]
    if indexed:
        out += ["", "The outbox's indexes (kB): after minute 1, at their peak, at the end."]
        out += ["", "| index | minute 1 | peak | end |", "|---|---|---|---|"]
        for name in indexed[0]["outbox_index_bytes"]:
            sizes = [m["outbox_index_bytes"].get(name, 0) / 1024 for m in indexed]
            out.append(f"| {name} | {sizes[0]:,.0f} | {max(sizes):,.0f} | {sizes[-1]:,.0f} |")
    if plot is not None:
        out += ["", f"![{plot.stem}]({plot.name})"]
    return "\n".join(out) + "\n"


def plot_endurance(data: dict[str, Any], out: Path, stem: str = "endurance") -> Path | None:
    """Throughput per part, pgbroker's size (total and its largest tables), and the broker's RSS, per minute."""
    minutes = data["minutes"]
    if not minutes:
        return None
    plt = _matplotlib()
    xs = [m["minute"] for m in minutes]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for part in sorted({k for m in minutes for k in m["rates"]}):
        axes[0].plot(xs, [m["rates"].get(part, 0) for m in minutes], marker="o", label=part)
    axes[0].set_title("throughput per part (/s)", fontsize=9)
    axes[0].set_yscale("log")
    axes[1].plot(xs, [m["pgbroker_bytes"] / 1e6 for m in minutes], marker="o", label="pgbroker total", color="black")
    largest = sorted(minutes[-1]["tables"], key=lambda t: -minutes[-1]["tables"][t]["bytes"])[:5]
    for table in largest:
        axes[1].plot(xs, [m["tables"].get(table, {"bytes": 0})["bytes"] / 1e6 for m in minutes], label=table)
    axes[1].set_title("size (MB)", fontsize=9)
    axes[1].set_ylim(bottom=0)
    axes[2].plot(xs, [m["broker_rss_kb"] / 1024 for m in minutes], marker="o", label="broker RSS (MB)")
    axes[2].plot(xs, [m["outbox_backlog"] / 1000 for m in minutes], marker="o", label="outbox backlog (thousands)")
    axes[2].set_title("broker memory and outbox backlog", fontsize=9)
    axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("minute")
        ax.legend(fontsize=6)
    title = "Endurance" + ("" if data["settings"]["data"] else " (--no-data)")
    fig.suptitle(f"{title}: speed, size and memory minute by minute", fontsize=10)
    fig.tight_layout()
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def installs_markdown(data: dict[str, Any]) -> str:
    """The installs section: per call, each install's ratio to its floor and CPU/op, then the verdicts of
    bench_installs.verdicts (least privilege against superuser, this tree against the baseline)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import bench_installs

    names = data["installs"]
    judged = {(v["call"], v["install"]): v for v in bench_installs.verdicts(data)}
    out = [
        "## Installs (bench_installs.py)",
        "",
        f"PostgreSQL {data.get('server', '?')}, {data['settings']['rounds']} alternating rounds of"
        f" {data['settings']['seconds']} s per (install, cycle); load average {data['load_start'][0]:.2f} at the start"
        f" and {data['load_end'][0]:.2f} at the end. Each cell: the call's throughput against its floor in the same"
        " database and the CPU per call (client + server); then, in bold, the least-privilege install's ratio"
        " against the superuser install's, and the superuser install's (this tree) against the baseline's"
        f" (target >= {bench_installs.TARGET}x)."
        + (f" This tree: commit {data['commit']}." if "commit" in data else "")
        + (f" The baseline is commit {data['baseline'][:10]}." if data.get("baseline") else ""),
        "",
        "| call | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for row in data["rows"]:
        cells = []
        for name in names:
            c = row["installs"].get(name)
            if c is None:
                cells.append("-")
                continue
            cell = f"{c['ratio']:.2f}x, {c['cpu_us']:,.0f} us"
            v = judged.get((row["call"], name))
            if v is not None:
                cell += f"; **{v['value']:.2f}x** {'ok' if v['ok'] else 'MISSED'}"
            cells.append(cell)
        out.append(f"| {row['call']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def churn_markdown(data: dict[str, Any]) -> str:
    """The churn section: client_unregister at two sizes and with a backlog (ratios, CPU per call), the mass
    departure, the churn run minute by minute, and the targets of bench_churn.verdicts."""
    m = data["micro"]
    s = data["settings"]
    out = [
        "## Churn (bench_churn.py)",
        "",
        f"PostgreSQL {data.get('server', '?')}, {data.get('cpus', '?')} CPUs, {data.get('date', '?')}"
        + (f", commit {data['commit']}" if "commit" in data else "")
        + f"; load average {data['load_start'][0]:.2f} at the start and {data['load_end'][0]:.2f} at the end."
        " client_unregister of a client with 10 subscriptions, median of 20 autocommit calls, just after"
        " client_register_many / subscribe_many with no ANALYZE (statistics stale: autovacuum off on pgbroker's"
        " tables), wall time and the server backend's CPU per call:",
        "",
        "| situation | wall | server CPU | ratio |",
        "|---|---|---|---|",
        f"| 1,000 x 10 | {m['small']['ms']:.2f} ms | {m['small']['cpu_ms']:.2f} ms | 1.00x |",
        f"| {s['clients']:,} x 10 | {m['large']['ms']:.2f} ms | {m['large']['cpu_ms']:.2f} ms"
        f" | {m['large']['ms'] / m['small']['ms']:.2f}x of 1,000 x 10 |",
        f"| {s['clients']:,} x 10, {m['pending']:,} outbox rows pending | {m['backlog']['ms']:.2f} ms"
        f" | {m['backlog']['cpu_ms']:.2f} ms | {m['backlog']['ms'] / m['large']['ms']:.2f}x of none pending |",
        f"| client_unregister_many of {m['mass']['clients']:,}, {m['mass']['pending']:,} pending"
        f" | {m['mass']['s']:.3f} s | {m['mass']['cpu_s']:.3f} s | |",
        "",
        f"Churn: {s['clients']:,} clients x 10 subscriptions loaded with no ANALYZE (autovacuum on), a writer at"
        f" {s['write_rate']} single-row UPDATEs/s, the broker draining, {s['churn_rate']} clients/s leaving and"
        " coming back (client_unregister, client_register, subscribe_many of 10, a read of the 10 rows) from"
        " sessions passing the epoch. Per minute: the registry calls' p50 / p99, the delivery p99 (the change's"
        " statement start to its row fetched), the churning backends' CPU per registry call.",
        "",
        "| minute | registry calls | registry p50 | registry p99 | rows delivered | delivery p99 | CPU per call |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in data["churn"]["minutes"]:
        out.append(
            f"| {x['minute']} | {x['registry_calls']:,} | {x['registry_p50_ms']:.2f} ms | {x['registry_p99_ms']:.2f} ms"
            f" | {x['delivered']:,} | {x['delivery_p99_ms']:.2f} ms | {x['cpu_per_call_ms']:.3f} ms |"
        )
    c = data["churn"]["mass"]
    out += [
        "",
        f"Then client_unregister_many of {c['clients']:,} clients ({c['pending']:,} rows pending):"
        f" {c['s']:.3f} s, {c['cpu_s']:.3f} s of server CPU. Errors during the run: {data['churn']['errors']}.",
        "",
        "| target | value | met |",
        "|---|---|---|",
    ]
    for v in data["verdicts"]:
        out.append(f"| {v['name']}: under {v['target']} | {v['value']:.3f} | {'met' if v['met'] else 'MISSED'} |")
    return "\n".join(out) + "\n"


def _figure(value: float) -> str:
    """A verdict's value: whole with thousands separators from 1,000 up, three decimals below."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"


def filters_markdown(data: dict[str, Any]) -> str:
    """The filters section (issue 43): the targets of bench_filters.verdicts, the UPDATE matching no filter against
    the same UPDATE with none, the CPU per UPDATE matching k subscriptions at each size beside the peer design, the
    bulk subscription rate, and the commit-to-Broker.notifications() latency of rows moving into and out of a
    filter (when the run has it)."""
    import json

    s = data["settings"]
    a, b = data["no_match"], data["by_size"]
    scale = s.get("scale", 1.0)
    out = [
        "## Filters (issue 43, bench_filters.py)",
        "",
        f"PostgreSQL {data.get('server', '?')}, {data.get('cpus', '?')} CPUs, {data.get('date', '?')}"
        + (f", commit {data['commit']}" if "commit" in data else "")
        + f"; load average {data['load_start'][0]:.2f} at the start and {data['load_end'][0]:.2f} at the end."
        + (
            f" A scaled run (--scale {scale:g}, --updates {s.get('updates', '?')}): its sizes are that fraction of"
            " the issue's (in parentheses where a name or a heading gives the issue's), and its figures are not the"
            " issue's."
            if scale != 1.0
            else ""
        ),
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
    ]
    for v in data["verdicts"]:
        target = f"{v.get('how', '')} {v['target']:,g}".strip()
        out.append(f"| {v['name']} | {_figure(v['value'])} | {target} | {'met' if v['met'] else 'MISSED'} |")
    out += [
        "",
        f"A single-row autocommit UPDATE of a row matching no filter, {a['updates']:,} on each table in"
        f" {a.get('rounds', 5)} interleaved rounds: a table with {a['subscriptions']:,} filter subscriptions on"
        f" {a['values']:,} values of `team` against its twin with none (both watched); throughput, and the writing"
        " backend's CPU per UPDATE (/proc), over all rounds; the ratios of the verdicts are the medians of the"
        " rounds' ratios:",
        "",
        "| table | updates/s | CPU per UPDATE |",
        "|---|---|---|",
        f"| plain, no filter subscriptions | {a['plain']['updates_per_s']:,.0f}/s"
        f" | {a['plain']['cpu_us_per_update']:,.1f} us |",
        f"| filtered, {a['subscriptions']:,} on {a['values']:,} values | {a['filtered']['updates_per_s']:,.0f}/s"
        f" | {a['filtered']['cpu_us_per_update']:,.1f} us |",
        f"| filtered / plain, the median of the rounds' | {a['throughput_ratio']:.2f}x | {a['cpu_ratio']:.2f}x |",
    ]
    ks = sorted(b["pgbroker"], key=int)
    sizes = sorted(b["pgbroker"][ks[0]], key=int)
    real = b.get("subscriptions", {})  # this run's number at each of the sizes (a scaled run's differ)

    def head(size: str) -> str:
        n = real.get(size, int(size))
        return f"{int(size):,}" + (f" ({n:,})" if n != int(size) else "")

    small, large = sizes[0], sizes[-1]
    out += [
        "",
        "CPU per UPDATE (the writing backend's, us) of a row that k filter subscriptions match, among the number in"
        " all that heads each column, pgbroker beside the peer design (a trigger that evaluates every subscription"
        " row by row for each changed row, as Supabase Realtime's WALRUS does):",
        "",
        "| k | "
        + " | ".join(f"pgbroker, {head(n)}" for n in sizes)
        + f" | pgbroker, {int(large):,} / {int(small):,} | "
        + " | ".join(f"peer, {head(n)}" for n in sizes)
        + " |",
        "|---|" + "---|" * (2 * len(sizes) + 1),
    ]
    for k in ks:
        ours, peer = b["pgbroker"][k], b["peer"][k]
        ratio = ours[large]["cpu_us"] / max(ours[small]["cpu_us"], 1e-9)
        out.append(
            f"| {k} | "
            + " | ".join(f"{ours[n]['cpu_us']:,.0f} us" for n in sizes)
            + f" | {ratio:.2f}x | "
            + " | ".join(f"{peer[n]['cpu_us']:,.0f} us" for n in sizes)
            + " |"
        )
    if b.get("ranges"):
        out += [
            "",
            'The same with range filters on a twin table (`{"team": {"gte": -k, "lte": -k}}` for the k'
            " clients, a range `[v, v + 1)` of its own for each other one), found by the interest's SP-GiST index:",
            "",
            "| k | "
            + " | ".join(f"ranges, {head(n)}" for n in sizes)
            + f" | ranges, {int(large):,} / {int(small):,} |",
            "|---|" + "---|" * (len(sizes) + 1),
        ]
        for k in ks:
            ours = b["ranges"][k]
            ratio = ours[large]["cpu_us"] / max(ours[small]["cpu_us"], 1e-9)
            out.append(f"| {k} | " + " | ".join(f"{ours[n]['cpu_us']:,.0f} us" for n in sizes) + f" | {ratio:.2f}x |")
    bulk = a["bulk"]
    out += [
        "",
        f"Bulk: `Broker.subscribe_filters` of {bulk['filters']:,} filters (ten clients on each value, given client"
        f" after client, {bulk['filters'] // 100:,} sets of ten clients sharing ten values), its defaults: batches"
        f" of {s.get('batch', 10_000):,} grouped by filter and by the clients the filters share, two at a time on"
        f" two registry connections, the clients registered first: {bulk['s']:.2f} s,"
        f" {bulk['filters_per_s']:,.0f} filters/s.",
    ]
    lat = data.get("latency")
    if lat is not None:
        out += [
            "",
            "Delivery: a Python `Broker` (its defaults) with one client subscribed by filter"
            f" (`{json.dumps(lat['filter'])}`),"
            f" beside {lat['subscriptions']:,} filter subscriptions of other clients on {lat['values']:,} other values,"
            " consumes `Broker.notifications()` in a thread while a writer in the same process moves rows into the"
            " filter and out of it (delivered with the client in `left`), an autocommit UPDATE every"
            f" {lat['period_ms']:g} ms, {lat['changes']:,} changes; the latency runs from the writer's commit returning"
            f" to the batch reaching the handler. Load average {lat['load_start'][0]:.2f} at its start and"
            f" {lat['load_end'][0]:.2f} at its end; {lat['negative']} samples negative (the handler ran before the"
            " commit call returned).",
            "",
            "| change | n | p50 | p99 | max |",
            "|---|---|---|---|---|",
        ]
        for way, label in (("in", "row moving in"), ("out", "row moving out"), ("all", "all")):
            x = lat[way]
            out.append(f"| {label} | {x['n']:,} | {x['p50_ms']:.2f} ms | {x['p99_ms']:.2f} ms | {x['max_ms']:.2f} ms |")
    return "\n".join(out) + "\n"


def on_demand_markdown(out: Path) -> str:
    """The sections of the on-demand runs whose JSON files are in out (empty when none is)."""
    parts = [endurance_markdown(data, plot_endurance(data, out, stem)) for stem, data in load_endurance(out)]
    if (out / INSTALLS_FILE).exists():
        parts.append(installs_markdown(_load(out / INSTALLS_FILE)))
    if (out / CHURN_FILE).exists():
        parts.append(churn_markdown(_load(out / CHURN_FILE)))
    if (out / FILTERS_FILE).exists():
        parts.append(filters_markdown(_load(out / FILTERS_FILE)))
    return "".join("\n" + p for p in parts)


def write_report(sections: Sequence[Section], out: Path, machine: Machine | None = None) -> Path:
    """Write out/report.md and the PNGs beside it (matplotlib needed: ImportError says what to install), ending
    with the on-demand runs' sections (on_demand_markdown)."""
    out.mkdir(parents=True, exist_ok=True)
    plots, skipped = render_plots(sections, out)
    report = out / "report.md"
    report.write_text(
        render_markdown(machine or machine_info(), sections, plots, skipped) + "\n" + on_demand_markdown(out)
    )
    return report


def write_on_demand(out: Path) -> Path:
    """Rewrite only the on-demand sections at the end of an existing out/report.md; the rest stays as it is."""
    report = out / "report.md"
    text = report.read_text()
    cuts = [i for h in ON_DEMAND_HEADINGS if (i := text.find("\n" + h)) >= 0]
    kept = text[: min(cuts)] if cuts else text
    report.write_text(kept.rstrip("\n") + "\n" + on_demand_markdown(out))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter fan-out and primitives runs (noisier figures)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument(
        "--on-demand", action="store_true", help="rewrite only the on-demand runs' sections of DIR/report.md"
    )
    args = parser.parse_args(argv)
    try:
        _matplotlib()  # fail before minutes of benchmarks, not after
    except ImportError as exc:
        print(f"report.py: {exc}", file=sys.stderr)
        return 2
    if args.on_demand:
        if not (args.out / "report.md").exists():
            print(f"report.py: no {args.out / 'report.md'} to add the on-demand sections to", file=sys.stderr)
            return 2
        print(f"wrote {write_on_demand(args.out)}")
        return 0
    machine = machine_info()
    sections = run_all(args.quick)
    report = write_report(sections, args.out, machine)
    print(f"\nwrote {report} and its plots")
    failed = [s.name for s in sections if s.results is None]
    if failed:
        print(f"benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark report's rendering (tests/benchmarks/report.py), on Results of the real benchmark classes.

The benchmarks themselves run on demand only; here the Results are filled
through the benchmarks' own methods (``add``, ``compare``, ``note``) with
figures of the shapes they print, and the report is written to tmp_path.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_report():
    spec = importlib.util.spec_from_file_location("pgbroker_bench_report", BENCH / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _bench(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def report():
    return _load_report()


@pytest.fixture(scope="module")
def sections(report):
    lease_mod, fanout_mod, prim_mod = _bench("bench_lease"), _bench("bench_fanout"), _bench("bench_primitives")

    lease = lease_mod.Results()
    lease.add("claim+release cycles/s (psycopg)", "620/s (1.61 ms)", "1,587/s (0.63 ms)", "2.55x", "<= 1.3x MISSED")
    lease.add("takeover after SIGKILL p50 (n=30)", "4.4 ms", "3.6 ms", "1.22x", "")
    lease.add("takeover after SIGKILL p95 (n=30)", "6.7 ms", "4.7 ms", "1.43x", "< 50 ms ok")
    lease.figures.update(takeover_p50_ms=4.4, takeover_p95_ms=6.7, seconds=60.0)

    fanout = fanout_mod.Results()
    for writers, tps, cpu in ((1, "0.75x", "2.16x"), (8, "0.55x", "2.40x")):
        s = "s" if writers > 1 else ""
        fanout.add(f"UPDATE tps, {writers} writer{s}: pgbroker, statement mode", "2,365 tps", "3,172 tps", tps,
                   ">= 0.75x ok")  # fmt: skip
        fanout.add(f"  CPU per transaction, {writers} writer{s}: pgbroker, statement mode", "396 us", "183 us", cpu,
                   "<= 1.5x MISSED")  # fmt: skip
        for design in ("pgbroker, row mode", "peer c: transactional outbox"):
            fanout.add(f"UPDATE tps, {writers} writer{s}: {design}", "2,600 tps", "3,172 tps", "0.82x", "(info)")
            fanout.add(f"  CPU per transaction, {writers} writer{s}: {design}", "300 us", "183 us", "1.64x", "(info)")
        fanout.add(f"row mode vs transactional outbox, tps, {writers} writer{s}", "2,600 tps", "2,600 tps", "1.00x",
                   ">= 0.9x ok")  # fmt: skip
    fanout.add("  broker backend CPU per delivered row, 1 writer", "80.7 us", "", "", "<= 12 us MISSED")
    fanout.add("  NOTIFYs received while draining, 1 writer", "12 (1.2/s)", "~4,000 txns", "0.0030/txn", "<< 1/txn")
    fanout.add("commit-to-handler latency p99 (n=250)", "3.10 ms", "1.20 ms", "2.58x", "< 10 ms ok")
    fanout.add("single-row UPDATE p50, 10k vs 100 clients", "0.410 ms", "0.400 ms", "1.02x", "~1x (<= 1.2x) ok")
    fanout.note("a note | with a pipe")

    prim = prim_mod.Results()
    floor = prim_mod.Rate(ops=10_000, seconds=2.0, cpu=0.8)
    ours = prim_mod.Rate(ops=8_000, seconds=2.0, cpu=0.9)
    peer = prim_mod.Rate(ops=5_000, seconds=2.0, cpu=1.1)
    for procs in (1, 8):
        prim.compare(f"lock acquire+release, Python Lock, {procs} proc", ours, floor, 0.8, f"py_lock_{procs}")
        prim.compare(f"lock acquire+release, SQL functions, {procs} proc", ours, floor, 0.8, f"lock_{procs}")
        prim.compare(f"peer pals, lock cycles, {procs} proc", peer, floor, None, f"pals_{procs}")
    prim.add(
        "release -> next waiter, LISTEN + retry (n=40)",
        "p50 1.20 ms, p99 3.40 ms",
        "p50 0.80 ms, p99 2.00 ms",
        "1.7x",
        "p99 < 10 ms ok",
    )
    prim.notes.append("tooz (pgsql driver) skipped: No module named 'tooz'")

    scale = _bench("bench_scale").Results()
    scale.add("30k x 10: takeover claim after SIGKILL (median of 3)", "9.0 ms", "6.6 ms", "1.37x", "<= 2x ok")
    for n, claim, rate, e2e in ((1_000, 4.5, 92_000, 0.2), (30_000, 9.0, 100_000, 3.1)):
        scale.point("takeover claim (ms)", n, claim)
        scale.point("empty-state claim (ms)", n, 6.6)
        scale.point("batched, SQL arrays (subs/s)", n, rate)
        scale.point("floor INSERT ... SELECT (rows/s)", n, 2.5 * rate)
        scale.point("end to end (s)", n, e2e)
        scale.point("watched single-row UPDATE, backend CPU (us)", n, 200.0)

    return [
        report.Section("lease", "Broker lease (bench_lease.py)", lease, settings="full", seconds=60),
        report.Section("fanout", "Fan-out (bench_fanout.py)", fanout, settings="--quick", seconds=90),
        report.Section("primitives", "Primitives and peers (bench_primitives.py)", prim, settings="--quick"),
        report.Section("scale", "Restart at size (bench_scale.py)", scale, settings="--quick"),
        report.Section("broken", "A benchmark that failed", None, error="Traceback ...\nRuntimeError: boom"),
    ]


def test_markdown_has_every_row_and_the_machine(report, sections, tmp_path):
    machine = report.machine_info()
    assert machine.cpus >= 1 and machine.cpu_model
    text = report.render_markdown(machine, sections, [], [])
    for section in sections:
        assert f"## {section.title}" in text
        for metric, ours, _floor, ratio, target in section.results.rows if section.results else []:
            line = next((ln for ln in text.splitlines() if metric.strip().replace("|", "\\|") in ln), None)
            assert line is not None, metric
            assert ours in line and ratio in line and target in line
            assert line.startswith("| ") and line.count(" | ") == 4, line
    assert "a note \\| with a pipe" not in text  # notes are list items, not table cells
    assert "- note: a note | with a pipe" in text
    assert "RuntimeError: boom" in text
    assert f"{machine.cpus} CPUs" in text and "PostgreSQL" in text
    assert "targets missed: claim+release cycles/s (psycopg)." in text


def test_ratio_rows_parse_the_printed_ratio_and_target(report, sections):
    rows = report.ratio_rows(sections[1].results.rows)
    by_metric = {r[0]: r for r in rows}
    assert by_metric["UPDATE tps, 1 writer: pgbroker, statement mode"][1:] == (0.75, 0.75, ">=", "ok")
    assert by_metric["CPU per transaction, 1 writer: pgbroker, statement mode"][1:] == (2.16, 1.5, "<=", "MISSED")
    assert by_metric["commit-to-handler latency p99 (n=250)"][2] is None  # a target in ms is not a ratio
    assert "broker backend CPU per delivered row, 1 writer" not in by_metric  # no ratio
    assert "NOTIFYs received while draining, 1 writer" not in by_metric  # per txn, not a ratio to a floor


def test_report_writes_markdown_and_valid_pngs(report, sections, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib absent: python3 -m pip install -e '.[bench]'")
    path = report.write_report(sections, tmp_path / "out")
    text = path.read_text()
    pngs = sorted((tmp_path / "out").glob("*.png"))
    names = {p.name for p in pngs}
    assert names == {"ratios_lease.png", "ratios_fanout.png", "ratios_primitives.png", "ratios_scale.png",
                     "lock_peers.png", "fanout_designs.png", "latencies.png", "scale.png"}  # fmt: skip
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, png
        assert f"]({png.name})" in text
    assert "no ratio plot for A benchmark that failed: the benchmark failed" in text
    assert "no latency histograms" in text
    for section in sections[:4]:
        for metric, *_ in section.results.rows:
            assert metric.strip().replace("|", "\\|") in text
    lat = {label: (a, b) for label, a, b in report.latency_rows(sections)}
    assert lat["takeover after SIGKILL p95 (n=30)"] == (6.7, 4.7)
    assert lat["release -> next waiter, LISTEN + retry (n=40) p99"] == (3.4, 2.0)


def test_the_designs_are_read_side_by_side_for_their_plot(report, sections):
    designs = report.design_rows(sections)
    assert list(designs["UPDATE tps"]) == [
        "pgbroker, statement mode", "pgbroker, row mode", "peer c: transactional outbox",
    ]  # fmt: skip
    assert designs["UPDATE tps"]["pgbroker, statement mode"] == {1: 0.75, 8: 0.55}
    assert designs["CPU per transaction"]["pgbroker, statement mode"] == {1: 2.16, 8: 2.4}
    assert designs["CPU per transaction"]["peer c: transactional outbox"] == {1: 1.64, 8: 1.64}
    # The target rows (row mode against the outbox) are not designs.
    assert not any("vs" in d for d in designs["UPDATE tps"])
    assert report.design_rows(sections[:1]) == {"UPDATE tps": {}, "CPU per transaction": {}}


def test_missing_matplotlib_says_what_to_install(report, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(ImportError, match=r"pip install -e '\.\[bench\]'"):
        report._matplotlib()


def _endurance_minutes(n: int, shrink: bool) -> list[dict]:
    """Minutes of the shape bench_endurance.py records: steady rates, sizes flat (or growing)."""
    minutes = []
    for i in range(1, n + 1):
        size = 10_000_000 + (0 if shrink else 2_000_000 * i)
        minutes.append({
            "minute": i, "rates": {"writes": 400.0, "fetched": 390.0, "locks": 100.0, "rate_limit": 100.0},
            "pgbroker_bytes": size,
            "tables": {"outbox": {"bytes": size // 2, "dead": 10}, "lock_name": {"bytes": size // 2, "dead": 5}},
            "outbox_backlog": 12, "broker_rss_kb": 40_000, "upkeep": {},
        })  # fmt: skip
    return minutes


def test_the_endurance_targets_and_their_section(report, tmp_path):
    endurance = _bench("bench_endurance")
    flat = _endurance_minutes(30, shrink=True)
    verdicts = {v["target"]: v for v in endurance.verdicts(flat, data=False)}
    assert all(v["ok"] for v in verdicts.values() if v["limit"] is not None), verdicts
    assert verdicts["writes/s, last 10 min / first 10 min"]["value"] == 1.0
    growing = {v["target"]: v for v in endurance.verdicts(_endurance_minutes(30, shrink=False), data=False)}
    assert not growing["pgbroker size: its peak, growth over the last 10 min"]["ok"]
    assert not growing["pgbroker size at its peak / its size after the first minute"]["ok"]
    data = {"settings": {"minutes": 30, "names": 1_000_000, "data": False, "writers": 4, "rows": 10_000,
                         "clients": 1000, "per_client": 10, "churn_per_s": 10},
            "server": "15.18", "minutes": flat, "verdicts": endurance.verdicts(flat, data=False)}  # fmt: skip
    text = report.endurance_markdown(data, None)
    assert "## Endurance (bench_endurance.py --no-data)" in text and "| 30 | 390 | 100 | 100 | 400 | 10.0 |" in text
    pytest.importorskip("matplotlib", reason="matplotlib absent: python3 -m pip install -e '.[bench]'")
    out = tmp_path / "out"
    out.mkdir()
    (out / report.ENDURANCE_FILE).write_text(json.dumps(data))
    path = report.write_report([], out)
    assert "![endurance](endurance.png)" in path.read_text()
    assert (out / "endurance.png").read_bytes()[:8] == PNG_MAGIC


def test_the_servers_cpu_per_operation_is_shown_beside_the_throughput(report):
    """CPU seconds over (writes + primitive calls) x seconds, per minute in the table and window against window
    among the verdicts, shown, not judged; an --in-memory run says so in its heading."""
    endurance = _bench("bench_endurance")
    minutes = _endurance_minutes(30, shrink=True)
    for m in minutes:  # 600 operations/s (writes 400, locks 100, rate_limit 100), 30 CPU seconds a minute
        m["seconds"], m["server_cpu_s"] = 60.0, 30.0 * m["minute"]
    cpu = {v["target"]: v for v in endurance.verdicts(minutes, data=False)}[
        "server CPU per operation, last 10 min / first 10 min (not judged: the disk's part is not in it)"
    ]
    assert cpu["value"] == pytest.approx(1.0) and cpu["ok"] is None and cpu["limit"] is None
    assert endurance.cpu_ms_per_op(minutes[1:2], minutes[0]) == pytest.approx(30_000 / 36_000)
    assert endurance.cpu_ms_per_op(minutes[:1], None) is None  # nothing before the first minute to subtract
    data = {"settings": {"minutes": 30, "names": 1_000_000, "data": False, "in_memory": True, "writers": 4,
                         "rows": 10_000, "clients": 1000, "per_client": 10, "churn_per_s": 10},
            "server": "15.18", "minutes": minutes}  # fmt: skip
    text = report.endurance_markdown(data, None)
    assert "## Endurance (bench_endurance.py --no-data --in-memory)" in text and "on a tmpfs (/dev/shm)" in text
    row = next(line for line in text.splitlines() if line.startswith("| 2 | "))
    assert "| 0.83 |" in row
    assert endurance.default_out(False, True).name == "endurance_no_data_in_memory.json"


def test_the_outbox_indexes_are_shown_after_the_first_minute_at_their_peak_and_at_the_end(report):
    minutes = _endurance_minutes(3, shrink=True)
    for m, kb in zip(minutes, (16, 2400, 64), strict=True):
        m["outbox_index_bytes"] = {"outbox_name_epoch_id": kb * 1024, "outbox_unresolved": 8192}
    data = {"settings": {"minutes": 3, "names": 1000, "data": False, "writers": 4, "rows": 10_000,
                         "clients": 1000, "per_client": 10, "churn_per_s": 10},
            "server": "15.18", "minutes": minutes}  # fmt: skip
    text = report.endurance_markdown(data, None)
    assert "| outbox_name_epoch_id | 16 | 2,400 | 64 |" in text and "| outbox_unresolved | 8 | 8 | 8 |" in text
    data["minutes"] = _endurance_minutes(3, shrink=True)  # a run recorded before the indexes were: no table
    assert "The outbox's indexes" not in report.endurance_markdown(data, None)


def test_with_data_the_growth_is_also_judged_less_the_data_tables():
    endurance = _bench("bench_endurance")
    minutes = _endurance_minutes(30, shrink=True)
    for i, m in enumerate(minutes):  # kv_set on new names: kv_entry grows by 1 MB a minute, the rest stays flat
        m["tables"]["kv_entry"] = {"bytes": 1_000_000 * (i + 1), "dead": 0}
        m["pgbroker_bytes"] += 1_000_000 * (i + 1)
    verdicts = {v["target"]: v for v in endurance.verdicts(minutes, data=True)}
    assert not verdicts["pgbroker size: its peak, growth over the last 10 min"]["ok"]
    assert (
        verdicts["pgbroker size, less the data (kv_entry, counter): its peak, growth over the last 10 min"]["value"]
        == 0.0
    )


def test_the_size_is_judged_on_its_peak_not_on_where_two_samples_fall_in_the_vacuum_cycle():
    endurance = _bench("bench_endurance")
    minutes = _endurance_minutes(30, shrink=True)
    for m in minutes:  # a band: 10 MB after a vacuum, 11 MB before the next; minute 20 low, minute 30 high
        m["pgbroker_bytes"] = 11_000_000 if m["minute"] % 2 == 0 and m["minute"] != 20 else 10_000_000
    verdicts = {v["target"]: v for v in endurance.verdicts(minutes, data=False)}
    assert verdicts["pgbroker size: its peak, growth over the last 10 min"]["value"] == 0.0
    ends = verdicts["pgbroker size, last minute / 10 min before (not judged: it swings with the vacuum cycle)"]
    assert round(ends["value"], 3) == 0.1 and ends["ok"] is None and ends["limit"] is None
    minutes[24]["pgbroker_bytes"] = 12_000_000  # a new high-water mark in the last ten minutes
    verdicts = {v["target"]: v for v in endurance.verdicts(minutes, data=False)}
    assert not verdicts["pgbroker size: its peak, growth over the last 10 min"]["ok"]
    minutes[0]["pgbroker_bytes"] = 5_000_000  # the peak, not the last minute, against the first
    verdicts = {v["target"]: v for v in endurance.verdicts(minutes, data=False)}
    assert verdicts["pgbroker size at its peak / its size after the first minute"]["value"] == 2.4


def _installs_data() -> dict:
    def cell(ratio: float) -> dict:
        return {"per_second": 900.0 * ratio, "cpu_us": 300.0, "floor_per_second": 900.0, "floor_cpu_us": 250.0,
                "ratio": ratio}  # fmt: skip

    return {
        "settings": {"seconds": 2.0, "rounds": 4}, "target": 0.95, "server": "15.18", "baseline": None,
        "installs": ["superuser", "least privilege", "baseline abc"],
        "load_start": [1.0, 1.0, 1.0], "load_end": [2.0, 2.0, 2.0],
        "rows": [
            {"call": "counter_add, 1 proc", "procs": 1,
             "installs": {"superuser": cell(0.8), "least privilege": cell(0.776), "baseline abc": cell(0.8)}},
            {"call": "lock acquire + release, SQL functions, 8 proc", "procs": 8,
             "installs": {"superuser": cell(0.9), "least privilege": cell(0.81), "baseline abc": cell(1.0)}},
        ],
    }  # fmt: skip


def test_the_installs_section(report):
    text = report.installs_markdown(_installs_data())
    assert "| call | superuser | least privilege | baseline abc |" in text
    assert "| counter_add, 1 proc | 0.80x, 300 us | 0.78x, 300 us; **0.97x** ok | 0.80x, 300 us; **1.00x** ok |" in text
    # 8 proc: least privilege 0.81 / 0.9 = 0.90x; this tree against the baseline 0.9 / 1.0 = 0.90x
    assert "0.81x, 300 us; **0.90x** MISSED | 1.00x, 300 us; **0.90x** MISSED |" in text


def test_on_demand_rewrites_only_the_sections_of_the_on_demand_runs(report, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib absent: python3 -m pip install -e '.[bench]'")
    out = tmp_path / "out"
    out.mkdir()
    head = "# pgbroker benchmark report\n\n## Broker lease (bench_lease.py)\n\n| a | b |\n"
    (out / "report.md").write_text(head + "\n## Installs (bench_installs.py)\n\nan older run\n")
    (out / report.INSTALLS_FILE).write_text(json.dumps(_installs_data()))
    minutes = _endurance_minutes(3, shrink=True)
    settings = {"minutes": 3, "names": 1_000_000, "data": False, "writers": 4, "rows": 10_000, "clients": 1000,
                "per_client": 10, "churn_per_s": 10}  # fmt: skip
    (out / "endurance_no_data.json").write_text(json.dumps({"settings": settings, "minutes": minutes}))
    text = report.write_on_demand(out).read_text()
    assert text.startswith(head) and "an older run" not in text
    assert text.index("## Endurance (bench_endurance.py --no-data)") < text.index("## Installs (bench_installs.py)")
    assert "![endurance_no_data](endurance_no_data.png)" in text
    assert (out / "endurance_no_data.png").read_bytes()[:8] == PNG_MAGIC
    assert report.write_on_demand(out).read_text() == text  # rewriting again changes nothing


def _churn_data() -> dict:
    bench_churn = _bench("bench_churn")
    micro = {
        "small": {"ms": 0.5, "cpu_ms": 0.4},
        "large": {"ms": 0.6, "cpu_ms": 0.5},
        "backlog": {"ms": 1.5, "cpu_ms": 1.2},
        "pending": 99_960,
        "mass": {"clients": 10_000, "s": 0.8, "cpu_s": 0.7, "pending": 99_000},
    }
    minutes = [
        {"minute": m, "registry_calls": 36_000, "registry_p50_ms": 1.0, "registry_p99_ms": 4.0 + m, "delivered": 12_000,
         "delivery_p99_ms": 15.0, "cpu_per_call_ms": 0.3}
        for m in (1, 2)
    ]  # fmt: skip
    data = {
        "server": "15.18", "cpus": 2, "date": "2026-12-04 17:00 UTC", "load_start": [1.0], "load_end": [1.5],
        "micro": micro, "churn": {"minutes": minutes, "mass": {"clients": 10_000, "s": 1.2, "cpu_s": 0.9, "pending": 5},
                                  "errors": 0},
        "settings": {"clients": 30_000, "per_client": 10, "backlog": 100_000, "churn_rate": 200, "write_rate": 200,
                     "minutes": 2},
    }  # fmt: skip
    data["verdicts"] = bench_churn.verdicts(data)
    return data


def test_churn_section_gives_ratios_cpu_per_call_and_the_targets(report, tmp_path):
    data = _churn_data()
    text = report.churn_markdown(data)
    assert text.startswith("## Churn (bench_churn.py)")
    assert "| 30,000 x 10 | 0.60 ms | 0.50 ms | 1.20x of 1,000 x 10 |" in text
    assert "| 30,000 x 10, 99,960 outbox rows pending | 1.50 ms | 1.20 ms | 2.50x of none pending |" in text
    assert "| 2 | 36,000 | 1.00 ms | 6.00 ms | 12,000 | 15.00 ms | 0.300 ms |" in text
    verdicts = {v["name"]: v["met"] for v in data["verdicts"]}
    assert verdicts["unregister at 30,000 x 10 over 1,000 x 10"] is True
    assert verdicts["unregister with 100,000 pending over none"] is False  # 2.5x
    assert verdicts["churn: mass departure of 10,000 (s)"] is False  # 1.2 s
    assert text.count("MISSED") == 2
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("# pgbroker benchmark report\n")
    (out / report.CHURN_FILE).write_text(json.dumps(data))
    assert "## Churn (bench_churn.py)" in report.write_on_demand(out).read_text()


def _filters_data(latency: bool = True) -> dict:
    bench_filters = _bench("bench_filters")
    sizes = ("1000", "10000", "100000")
    cpu = {"1": (40.0, 42.0, 44.0), "10": (60.0, 62.0, 66.0), "100": (200.0, 210.0, 320.0)}
    peer = {k: (300.0, 2_500.0, 25_000.0) for k in cpu}
    data = {
        "server": "15.18", "cpus": 2, "date": "2026-12-05 12:00 UTC", "commit": "abc1234",
        "load_start": [1.0], "load_end": [1.5],
        "no_match": {
            "plain": {"updates_per_s": 2_000.0, "cpu_us_per_update": 100.0},
            "filtered": {"updates_per_s": 1_900.0, "cpu_us_per_update": 105.0},
            "throughput_ratio": 0.95, "cpu_ratio": 1.05, "subscriptions": 100_000, "values": 10_000, "updates": 5_000,
            "bulk": {"filters": 100_000, "s": 1.25, "filters_per_s": 80_000.0},
        },
        "by_size": {
            "pgbroker": {k: {n: {"cpu_us": c, "ms": 1.0} for n, c in zip(sizes, v, strict=True)}
                         for k, v in cpu.items()},
            "peer": {k: {n: {"cpu_us": c, "ms": 9.0} for n, c in zip(sizes, v, strict=True)} for k, v in peer.items()},
            "subscriptions": {n: int(n) for n in sizes},
        },
        "settings": {"scale": 1.0, "updates": 5_000, "subscriptions": 100_000, "values": 10_000,
                     "sizes": [1_000, 10_000, 100_000], "ks": [1, 10, 100], "batch": 10_000},
    }  # fmt: skip
    if latency:
        data["latency"] = {
            "changes": 4_000, "period_ms": 5.0, "subscriptions": 100_000, "values": 10_000, "filter": {"team": 7},
            "in": {"n": 2_000, "p50_ms": 1.5, "p99_ms": 4.25, "max_ms": 9.0},
            "out": {"n": 2_000, "p50_ms": 1.75, "p99_ms": 12.5, "max_ms": 30.0},
            "all": {"n": 4_000, "p50_ms": 1.6, "p99_ms": 8.0, "max_ms": 30.0},
            "negative": 0, "load_start": [0.5], "load_end": [0.75],
        }  # fmt: skip
    data["verdicts"] = bench_filters.verdicts(data)
    return data


def test_filters_section_gives_the_targets_no_match_by_size_bulk_and_latency(report, tmp_path):
    data = _filters_data()
    text = report.filters_markdown(data)
    assert text.startswith("## Filters (issue 43, bench_filters.py)")
    assert "scaled run" not in text
    assert "| no-match UPDATE throughput, filtered / plain | 0.950 | >= 0.9 | met |" in text
    assert "| bulk filter subscription, filters/s | 80,000 | >= 50,000 | met |" in text
    assert "| k=100: CPU per UPDATE at 100,000 / at 1,000 subscriptions | 1.600 | <= 1.5 | MISSED |" in text
    assert "| commit to Broker.notifications(), row moving in, p99 (ms) | 4.250 | <= 10 | met |" in text
    assert "| commit to Broker.notifications(), row moving out, p99 (ms) | 12.500 | <= 10 | MISSED |" in text
    assert text.count("MISSED") == 2
    assert "| plain, no filter subscriptions | 2,000/s | 100.0 us |" in text
    assert "| filtered, 100,000 on 10,000 values | 1,900/s | 105.0 us |" in text
    assert "| filtered / plain, the median of the rounds' | 0.95x | 1.05x |" in text
    assert "| k | pgbroker, 1,000 | pgbroker, 10,000 | pgbroker, 100,000 | pgbroker, 100,000 / 1,000 |" in text
    assert "| 100 | 200 us | 210 us | 320 us | 1.60x | 300 us | 2,500 us | 25,000 us |" in text
    assert "batches of 10,000 grouped by filter and by the clients the filters share, two at a time" in text
    assert "80,000 filters/s" in text
    assert '(`{"team": 7}`)' in text
    assert "| row moving out | 2,000 | 1.75 ms | 12.50 ms | 30.00 ms |" in text
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("# pgbroker benchmark report\n")
    (out / report.CHURN_FILE).write_text(json.dumps(_churn_data()))
    (out / report.FILTERS_FILE).write_text(json.dumps(data))
    written = report.write_on_demand(out).read_text()
    assert written.index("## Churn (bench_churn.py)") < written.index("## Filters (issue 43, bench_filters.py)")
    assert report.write_on_demand(out).read_text() == written  # rewriting again changes nothing


def test_filters_section_of_a_scaled_run_and_of_one_without_the_latency(report):
    data = _filters_data(latency=False)
    assert not any("Broker.notifications()" in v["name"] for v in data["verdicts"])
    data["settings"]["scale"] = 0.01
    data["by_size"]["subscriptions"] = {"1000": 121, "10000": 121, "100000": 1_000}
    text = report.filters_markdown(data)
    assert "A scaled run (--scale 0.01, --updates 5000)" in text
    assert "| k | pgbroker, 1,000 (121) | pgbroker, 10,000 (121) | pgbroker, 100,000 (1,000) |" in text
    assert "Delivery:" not in text and "| change |" not in text

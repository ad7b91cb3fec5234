"""Recorded histories of concurrent operations, and checkers that verify them.

Several processes append to one history, each to a JSONL file of its own in
one directory (no locking, no interleaving).  Each operation is two lines:
``invoke`` when the call starts and ``complete`` when it returns, so that a
process killed mid-call leaves an operation of unknown outcome, not a gap.

Times are ``CLOCK_MONOTONIC`` in nanoseconds, which is one clock for every
process on a Linux machine (unlike ``time.monotonic_ns`` on other systems, and
unlike the wall clock, it never steps).

An operation's result is ``ok`` (it returned; its return values are in
``values``), ``failed`` (it definitely did not take effect, e.g. an SQL error
before anything changed) or ``unknown`` (the connection broke, the process
died, or the outcome cannot be known).  An ``ok`` call may still report "not
done": a lock_acquire that returned false, a compare-and-set that returned
NULL; those are values, not results.

Checkers take operations (loaded with :meth:`History.load`, or made by hand
in unit tests) and return a list of :class:`Violation` (empty: the history is
consistent).  Every checker is sound: client-side times are strictly inside
the server-side truth (a hold runs from the acquire's *completion* to the
release's *invocation*), so a violation found is a violation that happened.

- :func:`check_exclusion` / :func:`check_locks`: mutual exclusion (exclusive
  holders never overlap; shared ones never overlap an exclusive one);
- :func:`check_semaphore`: at most ``limit`` holders at any instant, permit
  numbers in 1..limit, one holder per permit at a time;
- :func:`check_counter`: the final value equals the sum of acknowledged
  increments (unknown ones may count or not), and returned values respect
  real-time order;
- :func:`check_cas`: successful compare-and-sets form a chain of versions
  (each one names the version the previous success wrote), no lost update;
- :func:`check_tokens`, :func:`check_fencing`, :func:`check_lease_history`:
  lease epochs unique and increasing in real-time order, no write accepted
  under a token older than a completed claim, and the server's
  ``pgbroker.lease_history`` agreeing with what clients were told.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, FAILED, UNKNOWN = "ok", "failed", "unknown"
FOREVER = 2**63 - 1  # the end of a hold never released, of a call never completed


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: comparable across the processes of one Linux machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Op:
    """One operation: who, what, when (invoke/complete in ns; complete None if it never returned), outcome."""

    process: str
    op: str
    key: str | None
    invoke: int
    complete: int | None
    result: str
    args: Mapping[str, Any] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)
    seq: int = 0

    @property
    def end(self) -> int:
        return FOREVER if self.complete is None else self.complete

    def __str__(self) -> str:
        done = "never" if self.complete is None else str(self.complete)
        return (
            f"{self.process}#{self.seq} {self.op}({self.key!r}, {dict(self.args)}) "
            f"[{self.invoke}..{done}] {self.result} {dict(self.values)}"
        )


@dataclass(frozen=True)
class Violation:
    kind: str
    message: str
    ops: tuple[Op, ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.kind}: {self.message}"]
        lines += [f"    {op}" for op in self.ops]
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Recording


class Call:
    """An operation in flight: say how it ended with :meth:`ok` or :meth:`fail`."""

    def __init__(self, recorder: Recorder, seq: int) -> None:
        self._recorder = recorder
        self._seq = seq
        self.done = False

    def ok(self, **values: Any) -> None:
        self._finish(OK, values)

    def fail(self, **values: Any) -> None:
        self._finish(FAILED, values)

    def unknown(self, **values: Any) -> None:
        self._finish(UNKNOWN, values)

    def _finish(self, result: str, values: dict[str, Any]) -> None:
        if self.done:
            raise RuntimeError("operation already completed")
        self.done = True
        self._recorder._write({"kind": "complete", "seq": self._seq, "t": now_ns(), "result": result, "values": values})


class Recorder:
    """Appends one process's operations to its own JSONL file of a history directory."""

    def __init__(self, directory: str | os.PathLike[str], process: str) -> None:
        self.process = process
        self.path = Path(directory) / f"{process}.jsonl"
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._seq = itertools.count(1)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    @contextlib.contextmanager
    def call(self, op: str, key: str | None = None, **args: Any) -> Iterator[Call]:
        """Record an operation around the block; an exception leaves it ``unknown`` (and propagates)."""
        seq = next(self._seq)
        self._write({"kind": "invoke", "seq": seq, "t": now_ns(), "op": op, "key": key, "args": args})
        pending = Call(self, seq)
        try:
            yield pending
        except BaseException as exc:
            if not pending.done:
                pending.unknown(error=f"{type(exc).__name__}: {exc}")
            raise
        if not pending.done:
            raise RuntimeError(f"operation {op} #{seq} neither ok() nor fail()")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class History:
    """A directory of per-process JSONL files."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def recorder(self, process: str) -> Recorder:
        return Recorder(self.directory, process)

    def load(self) -> list[Op]:
        """Every operation of every process, in invoke order; an invoke without completion is ``unknown``."""
        ops: list[Op] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            process = path.stem
            invokes: dict[int, dict[str, Any]] = {}
            completes: dict[int, dict[str, Any]] = {}
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a process killed mid-write: its last line is torn
                    continue
                (invokes if record["kind"] == "invoke" else completes)[record["seq"]] = record
            for seq, inv in invokes.items():
                done = completes.get(seq)
                ops.append(
                    Op(
                        process=process,
                        op=inv["op"],
                        key=inv["key"],
                        invoke=inv["t"],
                        complete=done["t"] if done else None,
                        result=done["result"] if done else UNKNOWN,
                        args=inv["args"],
                        values=done["values"] if done else {},
                        seq=seq,
                    )
                )
        ops.sort(key=lambda o: (o.invoke, o.process, o.seq))
        return ops


# ---------------------------------------------------------------------------
# Intervals of holders (locks, permits, leases)


@dataclass(frozen=True)
class Hold:
    """A holder of a resource from ``start`` to ``end`` (client-side: inside the server's hold)."""

    holder: str
    resource: str
    start: int
    end: int
    shared: bool = False
    token: Any = None
    ops: tuple[Op, ...] = ()


def _overlap(a: Hold, b: Hold) -> bool:
    return a.start <= b.end and b.start <= a.end


def check_exclusion(holds: Iterable[Hold]) -> list[Violation]:
    """No two holders of one resource overlap, except two shared holders; a holder never conflicts with itself."""
    violations: list[Violation] = []
    by_resource: dict[str, list[Hold]] = defaultdict(list)
    for h in holds:
        if h.end < h.start:
            violations.append(
                Violation("bad-interval", f"{h.holder} holds {h.resource!r} ending before it starts", h.ops)
            )
            continue
        by_resource[h.resource].append(h)
    for resource, items in by_resource.items():
        items.sort(key=lambda h: h.start)
        active: list[Hold] = []
        for h in items:
            active = [a for a in active if a.end >= h.start]
            for a in active:
                if a.holder != h.holder and not (a.shared and h.shared) and _overlap(a, h):
                    kind = "shared-exclusive-overlap" if a.shared or h.shared else "exclusive-overlap"
                    violations.append(
                        Violation(
                            kind,
                            f"{resource!r}: {a.holder} [{a.start}..{a.end}]"
                            f"{' shared' if a.shared else ''} overlaps {h.holder} [{h.start}..{h.end}]"
                            f"{' shared' if h.shared else ''} by {min(a.end, h.end) - h.start} ns",
                            a.ops + h.ops,
                        )
                    )
            active.append(h)
    return violations


@dataclass
class Unresolved:
    """Operations a checker could not count either way (unknown outcomes), reported beside violations."""

    ops: list[Op] = field(default_factory=list)


def lock_holds(
    ops: Iterable[Op], unresolved: Unresolved | None = None, anomalies: list[Violation] | None = None
) -> list[Hold]:
    """Hold intervals from ``acquire`` / ``release`` operations.

    ``acquire``: args ``shared`` (bool, default False); ok with values ``acquired`` true/false.
    ``release``: args ``shared``.  Holds stack like advisory locks: a process that acquired twice
    holds until its second release.  A hold runs from the completion of the acquire that took it
    to the invocation of the release that gave it back (FOREVER if none).  An acquire of unknown
    outcome starts no hold (it cannot be checked soundly) and is listed in ``unresolved``.
    """
    holds: list[Hold] = []
    open_: dict[tuple[str, str, bool], tuple[int, int, list[Op]]] = {}  # -> (start, depth, ops)
    for op in sorted(ops, key=lambda o: (o.process, o.seq)):
        if op.key is None or op.op not in ("acquire", "release"):
            continue
        shared = bool(op.args.get("shared", False))
        slot = (op.process, op.key, shared)
        if op.op == "acquire":
            if op.result == UNKNOWN:
                if unresolved is not None:
                    unresolved.ops.append(op)
                continue
            if op.result != OK or not op.values.get("acquired"):
                continue
            start, depth, taken = open_.get(slot, (op.end, 0, []))
            open_[slot] = (start, depth + 1, [*taken, op])
        elif slot in open_:
            start, depth, taken = open_[slot]
            if op.result == OK and op.values.get("released") is False:
                if anomalies is not None:
                    anomalies.append(Violation("release-refused", "a release of a held lock returned false", (op,)))
                continue  # the server says it did not hold it: nothing ends
            if depth > 1:
                open_[slot] = (start, depth - 1, [*taken, op])
            else:
                del open_[slot]
                holds.append(Hold(op.process, op.key, start, op.invoke, shared, ops=(*taken, op)))
    for (process, key, shared), (start, _, taken) in open_.items():
        holds.append(Hold(process, key, start, FOREVER, shared, ops=tuple(taken)))
    return holds


def check_locks(ops: Iterable[Op], unresolved: Unresolved | None = None) -> list[Violation]:
    """Mutual exclusion of named locks (exclusive and shared) over a recorded history; also a release
    that returned false while its process held the lock."""
    anomalies: list[Violation] = []
    holds = lock_holds(ops, unresolved, anomalies)
    return anomalies + check_exclusion(holds)


# ---------------------------------------------------------------------------
# Semaphores


def permit_holds(ops: Iterable[Op], unresolved: Unresolved | None = None) -> list[Hold]:
    """Hold intervals from ``acquire`` (ok with values ``permit``: int or None) and ``release`` operations.

    A process holds at most one permit of a name at a time (as the tests use it); its release ends it.
    """
    holds: list[Hold] = []
    open_: dict[tuple[str, str], Op] = {}
    for op in sorted(ops, key=lambda o: (o.process, o.seq)):
        if op.key is None:
            continue
        slot = (op.process, op.key)
        if op.op == "acquire":
            if op.result == UNKNOWN and unresolved is not None:
                unresolved.ops.append(op)
            if op.result == OK and op.values.get("permit") is not None:
                open_[slot] = op
        elif op.op == "release" and slot in open_:
            taken = open_.pop(slot)
            holds.append(Hold(op.process, op.key, taken.end, op.invoke, token=taken.values["permit"], ops=(taken, op)))
    for (process, key), taken in open_.items():
        holds.append(Hold(process, key, taken.end, FOREVER, token=taken.values["permit"], ops=(taken,)))
    return holds


def check_semaphore(ops: Iterable[Op], limit: int, unresolved: Unresolved | None = None) -> list[Violation]:
    """At most ``limit`` holders of a name at any instant; permits in 1..limit; one holder per permit."""
    holds = permit_holds(ops, unresolved)
    violations: list[Violation] = []
    for h in holds:
        permit = h.token
        if not isinstance(permit, int) or not 1 <= permit <= limit:
            violations.append(Violation("permit-out-of-range", f"permit {permit!r} not in 1..{limit}", h.ops))
    # One holder per (name, permit).
    per_permit = [Hold(h.holder, f"{h.resource}#{h.token}", h.start, h.end, ops=h.ops) for h in holds]
    violations += [Violation("permit-shared", v.message, v.ops) for v in check_exclusion(per_permit)]
    # Sweep: +1 at start, -1 after end (an end at t still counts at t: intervals are closed).
    by_name: dict[str, list[Hold]] = defaultdict(list)
    for h in holds:
        by_name[h.resource].append(h)
    for name, items in by_name.items():
        events = sorted([(h.start, 0, h) for h in items] + [(h.end, 1, h) for h in items], key=lambda e: e[:2])
        active: list[Hold] = []
        reported = False
        for t, kind, h in events:
            if kind == 0:
                active.append(h)
                if len(active) > limit and not reported:
                    reported = True  # one report per name: the first instant, with its holders
                    violations.append(
                        Violation(
                            "over-limit",
                            f"{name!r}: {len(active)} holders > limit {limit} at {t}: "
                            + ", ".join(f"{a.holder} (permit {a.token})" for a in active),
                            tuple(o for a in active for o in a.ops),
                        )
                    )
            else:
                active.remove(h)
    return violations


# ---------------------------------------------------------------------------
# Counters


def check_counter(ops: Iterable[Op], final: int, initial: int = 0, key: str | None = None) -> list[Violation]:
    """``add`` operations (args ``delta``; ok with values ``value``, the new value) against the final value.

    The final value must be ``initial`` + acknowledged deltas + some of the unknown ones; with positive
    deltas, returned values must be unique and respect real-time order (an add that completed before
    another was invoked returned less).
    """
    adds = [o for o in ops if o.op == "add" and (key is None or o.key == key)]
    acked = [o for o in adds if o.result == OK]
    unknown = [o for o in adds if o.result == UNKNOWN]
    base = initial + sum(int(o.args["delta"]) for o in acked)
    low = base + sum(min(0, int(o.args["delta"])) for o in unknown)
    high = base + sum(max(0, int(o.args["delta"])) for o in unknown)
    violations: list[Violation] = []
    if not low <= final <= high:
        violations.append(
            Violation(
                "lost-update" if final < low else "phantom-update",
                f"final {final}, but initial {initial} + {len(acked)} acknowledged adds = {base}"
                f" ({len(unknown)} unknown: allowed {low}..{high})",
            )
        )
    if acked and all(int(o.args["delta"]) > 0 for o in adds):
        seen: dict[int, Op] = {}
        for o in acked:
            value = o.values.get("value")
            if value in seen:
                violations.append(Violation("duplicate-value", f"two adds returned {value}", (seen[value], o)))
            seen[value] = o
        violations += _real_time_order(acked, lambda o: o.values["value"], "add")
    return violations


def _real_time_order(ops: Sequence[Op], order: Any, what: str) -> list[Violation]:
    """Ops sorted by ``order`` (a value that grows with every write) must not contradict real time:
    no B after A in that order that completed before A was invoked."""
    violations: list[Violation] = []
    latest: Op | None = None  # the op with the latest invoke among those earlier in the order
    for o in sorted(ops, key=order):
        if latest is not None and o.end < latest.invoke:
            violations.append(
                Violation(
                    "real-time-order",
                    f"{what} {order(o)!r} completed before {what} {order(latest)!r} was invoked, yet comes after it",
                    (latest, o),
                )
            )
        if latest is None or o.invoke > latest.invoke:
            latest = o
    return violations


# ---------------------------------------------------------------------------
# Compare-and-set (KV versions, counter_set values)


def check_cas(
    ops: Iterable[Op],
    initial: Any,
    final: Any = None,
    key: str | None = None,
) -> list[Violation]:
    """``cas`` operations: args ``expected`` (the version named); ok with values ``new`` (the version
    written, None when the compare failed).

    Successful CASes, in the order of the versions they wrote (which must grow), form a chain:
    the first names ``initial``, each next one names the version the previous one wrote.  A link
    may be a CAS of unknown outcome (its written version is then unknown too: the next success
    may name any version, and is reported in the message only if nothing could explain it).  Two
    successes naming one version is a lost update.  ``final``, when given, must be the last
    success's version (or an unknown's).
    """
    cas = [o for o in ops if o.op == "cas" and (key is None or o.key == key)]
    wins = [o for o in cas if o.result == OK and o.values.get("new") is not None]
    unknown = [o for o in cas if o.result == UNKNOWN]
    violations: list[Violation] = []
    by_expected: dict[Any, Op] = {}
    for o in wins:
        expected = o.args["expected"]
        if expected in by_expected:
            violations.append(
                Violation("lost-update", f"two successful CASes named version {expected!r}", (by_expected[expected], o))
            )
        by_expected[expected] = o
        if o.values["new"] == expected:
            violations.append(
                Violation("version-not-changed", f"a CAS wrote the version it named ({expected!r})", (o,))
            )
    chain = sorted(wins, key=lambda o: o.values["new"])
    unknown_expected = {o.args["expected"] for o in unknown}
    previous: Any = initial
    previous_op: Op | None = None
    for o in chain:
        expected = o.args["expected"]
        # Only an unknown CAS that named `previous` can have written a version other than this one names.
        if expected != previous and previous not in unknown_expected:
            violations.append(
                Violation(
                    "chain-broken",
                    f"a CAS named {expected!r} but the previous successful write made {previous!r}",
                    tuple(x for x in (previous_op, o) if x is not None),
                )
            )
        previous, previous_op = o.values["new"], o
    if final is not None and final != previous and previous not in unknown_expected:
        violations.append(
            Violation(
                "final-mismatch",
                f"final version {final!r}, last successful CAS wrote {previous!r}",
                tuple(x for x in (previous_op,) if x is not None),
            )
        )
    violations += _real_time_order(wins, lambda o: o.values["new"], "CAS writing")
    return violations


# ---------------------------------------------------------------------------
# Leases: fencing tokens (epochs)


def check_tokens(ops: Iterable[Op], op_name: str = "claim") -> list[Violation]:
    """Claims (ok with values ``token``): tokens unique and increasing in real-time order."""
    claims = [o for o in ops if o.op == op_name and o.result == OK and o.values.get("token") is not None]
    violations: list[Violation] = []
    seen: dict[Any, Op] = {}
    for o in claims:
        token = o.values["token"]
        if token in seen and seen[token].process != o.process:
            violations.append(Violation("token-reused", f"token {token!r} handed to two processes", (seen[token], o)))
        seen.setdefault(token, o)
    distinct = [o for o in claims if seen[o.values["token"]] is o]
    violations += _real_time_order(distinct, lambda o: o.values["token"], "claim of token")
    return violations


def check_fencing(ops: Iterable[Op], claim: str = "claim", write: str = "write") -> list[Violation]:
    """No write accepted under a token older than a claim that completed before the write was invoked.

    Claims: ok with values ``token``.  Writes: args ``token``; ok = accepted by the server.
    """
    ops = list(ops)
    claims = sorted(
        (o for o in ops if o.op == claim and o.result == OK and o.values.get("token") is not None),
        key=lambda o: o.end,
    )
    violations: list[Violation] = []
    for w in ops:
        if w.op != write or w.result != OK:
            continue
        newer = [c for c in claims if c.end < w.invoke and c.values["token"] > w.args["token"]]
        if newer:
            c = newer[0]
            violations.append(
                Violation(
                    "fenced-write-accepted",
                    f"write with token {w.args['token']!r} accepted after token {c.values['token']!r} was claimed",
                    (c, w),
                )
            )
    return violations


def lease_holds(ops: Iterable[Op], claim: str = "claim", release: str = "release") -> list[Hold]:
    """Holds of a lease: from a claim's completion to the same process's next release's invocation
    (or the process's next claim, or FOREVER)."""
    holds: list[Hold] = []
    by_process: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        by_process[o.process].append(o)
    for process, mine in by_process.items():
        mine.sort(key=lambda o: o.seq)
        current: Op | None = None
        for o in mine:
            if o.op == claim and o.result == OK and o.values.get("token") is not None:
                if current is not None and current.values["token"] != o.values["token"]:
                    holds.append(
                        Hold(
                            process, o.key or "", current.end, o.invoke, token=current.values["token"], ops=(current, o)
                        )
                    )
                if current is None or current.values["token"] != o.values["token"]:
                    current = o
            elif o.op == release and current is not None:
                holds.append(
                    Hold(process, o.key or "", current.end, o.invoke, token=current.values["token"], ops=(current, o))
                )
                current = None
        if current is not None:
            holds.append(
                Hold(process, current.key or "", current.end, FOREVER, token=current.values["token"], ops=(current,))
            )
    return holds


def check_lease_history(
    rows: Iterable[Mapping[str, Any]], ops: Iterable[Op] = (), name: str | None = None
) -> list[Violation]:
    """``pgbroker.lease_history`` rows (dicts with id, name, epoch, event) against what clients were told.

    Per lease name: the epochs of claim/takeover events, in event id order, are unique and strictly
    increasing; every token a client was told it claimed (``claim`` ok with values ``token``) is
    such an event; every release names an epoch that was claimed.
    """
    violations: list[Violation] = []
    claimed: dict[str, dict[Any, Mapping[str, Any]]] = defaultdict(dict)
    last: dict[str, Mapping[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r["id"]):
        lease = row["name"]
        if name is not None and lease != name:
            continue
        if row["event"] == "release":
            if row["epoch"] not in claimed[lease]:
                violations.append(
                    Violation(
                        "release-unclaimed",
                        f"{lease!r}: event {row['id']} releases epoch {row['epoch']!r}, never claimed",
                    )
                )
            continue
        if row["epoch"] in claimed[lease]:
            violations.append(
                Violation(
                    "epoch-reused",
                    f"{lease!r}: epoch {row['epoch']!r} claimed by events"
                    f" {claimed[lease][row['epoch']]['id']} and {row['id']}",
                )
            )
        elif lease in last and not row["epoch"] > last[lease]["epoch"]:
            violations.append(
                Violation(
                    "epoch-not-increasing",
                    f"{lease!r}: event {row['id']} claims epoch"
                    f" {row['epoch']!r} after event {last[lease]['id']} claimed"
                    f" {last[lease]['epoch']!r}",
                )
            )
        claimed[lease].setdefault(row["epoch"], row)
        last[lease] = row
    for o in ops:
        if o.op != "claim" or o.result != OK or o.values.get("token") is None:
            continue
        lease = o.key or ""
        if name is not None and lease != name:
            continue
        if o.values["token"] not in claimed[lease]:
            violations.append(
                Violation(
                    "claim-not-in-history",
                    f"{lease!r}: a client was told it claimed epoch"
                    f" {o.values['token']!r}, which lease_history does not show",
                    (o,),
                )
            )
    return violations

"""A linearizability checker: the Wing & Gong search with Lowe's memoisation, as Porcupine does it.

A history is a list of :class:`Operation`: who called what (``kind``, ``args``) on which ``key``,
when it was invoked and when it returned (``ret``, ns; None when it never returned or its outcome
is unknown) and what it returned (``output``; :data:`UNKNOWN` when not known).  It is
*linearizable* for a sequential model when every operation can be given a point between its
invocation and its return at which it takes effect atomically, in an order that the model
accepts with the outputs the clients saw.

- **The search** (Wing & Gong, with Lowe's improvements, as in Porcupine's ``checkSingle``): the
  invocations and returns, sorted by time, form a doubly linked list.  Walking it, an invocation
  may be linearized next when the model accepts it in the current state: its two entries are
  lifted out of the list and the search goes on from the head; meeting a return means the
  operation it ends was not linearized in time, so the last choice is undone and the next one
  tried.  Every (set of linearized operations, model state) reached is remembered, and a choice
  that leads back to one is skipped: the search is exhaustive, and memoisation keeps it from
  exploring the same situation twice.
- **Nondeterminism** (unknown outputs, states the model cannot pin down) by the power set: the
  search carries the frozen set of every state the model may be in.
- **Indeterminate operations** (a client killed in flight; ``ret`` None): their return is at
  infinity, so they may take effect any time after their invocation, with any output, or never.
  A session that ends (an ``end_session`` operation, a server ``crash``) ends them too: once it is
  linearized, the pending operations of the sessions it ends can no longer take effect and
  leave the search (which keeps the search space from doubling with each of them).
- **P-compositionality**: a history is linearizable when each key's sub-history is; operations
  without a key (``end_session``, ``crash``) belong to every key's.
- **A budget**: a key's search that needs more than :data:`MAX_STEPS` steps stops and reports
  the key undecided, a failure (linearizable histories of the tests need some 10,000; a
  non-linearizable one may need the whole search space before it is sure).

:func:`check` returns a :class:`Result`; when a key's history is not linearizable it names the
key, the longest linearized prefix the search found, and the operations it could not place.
:func:`write_artifacts` saves a history and an HTML visualisation (one row per client, a bar per
operation from invocation to return, the linearized prefix in order) for a failing check.

The models (:class:`KVModel`, :class:`CounterModel`, :class:`LockModel`, :class:`SemaphoreModel`,
:class:`LeaseModel`) are executable sequential specifications of pgbroker's primitives; each
``step(state, op)`` returns the states the operation may leave (empty: it cannot happen then).
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from history import OK, Op
from history import UNKNOWN as UNKNOWN_RESULT


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()  # the output of an operation whose outcome nobody saw
INFINITY = 2**63 - 1

GLOBAL_KINDS = frozenset({"end_session", "crash"})


@dataclass(frozen=True)
class Operation:
    """One call: ``client`` (a row of the picture), ``session`` (the server session it ran on)."""

    id: int
    client: str
    session: str
    kind: str
    key: str | None
    args: Mapping[str, Any]
    call: int
    ret: int | None
    output: Any = UNKNOWN

    @property
    def indeterminate(self) -> bool:
        return self.ret is None

    @property
    def end(self) -> int:
        return INFINITY if self.ret is None else self.ret

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items() if k != "session")
        out = "?" if self.output is UNKNOWN else repr(self.output)
        return f"{self.client} {self.kind}({self.key!r}{', ' + args if args else ''}) -> {out}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "client": self.client,
            "session": self.session,
            "kind": self.kind,
            "key": self.key,
            "args": dict(self.args),
            "call": self.call,
            "ret": self.ret,
            "output": None if self.output is UNKNOWN else self.output,
            "output_known": self.output is not UNKNOWN,
        }


def from_history(ops: Iterable[Op]) -> list[Operation]:
    """Operations of a recorded history (tests/history.py): args ``session`` names the session;
    values ``output`` the return value; an ``unknown`` (or torn) call is indeterminate."""
    result: list[Operation] = []
    for i, o in enumerate(sorted(ops, key=lambda o: (o.invoke, o.process, o.seq))):
        args = dict(o.args)
        session = str(args.pop("session", o.process))
        if o.result == OK:
            ret, output = o.complete, o.values.get("output")
        elif o.result == UNKNOWN_RESULT:
            ret, output = None, UNKNOWN
        else:  # failed: it did not take effect; it tells nothing
            continue
        result.append(Operation(i, o.process, session, o.op, o.key, args, o.invoke, ret, output))
    return result


def session_server(session: str) -> str:
    """Sessions are named '<pid>@<postmaster start>': the server they die with."""
    return session.rpartition("@")[2]


# ---------------------------------------------------------------------------
# The search


@dataclass
class _Entry:
    op: Operation | None
    is_call: bool
    time: int
    match: _Entry | None = None
    prev: _Entry | None = None
    next: _Entry | None = None


def _lift(entry: _Entry) -> None:
    """Take a call entry and its return out of the list."""
    assert entry.prev is not None
    entry.prev.next = entry.next
    if entry.next is not None:
        entry.next.prev = entry.prev
    ret = entry.match
    assert ret is not None and ret.prev is not None
    ret.prev.next = ret.next
    if ret.next is not None:
        ret.next.prev = ret.prev


def _unlift(entry: _Entry) -> None:
    ret = entry.match
    assert ret is not None and ret.prev is not None
    ret.prev.next = ret
    if ret.next is not None:
        ret.next.prev = ret
    assert entry.prev is not None
    entry.prev.next = entry
    if entry.next is not None:
        entry.next.prev = entry


@dataclass
class KeyResult:
    key: str | None
    ok: bool
    operations: list[Operation]
    linearized: list[tuple[Operation, tuple[Hashable, ...]]] = field(default_factory=list)  # longest prefix found
    stuck: list[Operation] = field(default_factory=list)  # determinate ops left out of that prefix
    steps: int = 0
    undecided: bool = False  # the search ran out of steps


@dataclass
class Result:
    ok: bool
    keys: list[KeyResult]
    model: str

    @property
    def failures(self) -> list[KeyResult]:
        return [k for k in self.keys if not k.ok]

    def summary(self) -> str:
        if self.ok:
            return f"linearizable ({self.model}, {len(self.keys)} keys)"
        lines = []
        for k in self.failures:
            verdict = f"undecided after {k.steps} search steps" if k.undecided else "not linearizable"
            lines.append(
                f"key {k.key!r} is {verdict} for {self.model}: {len(k.operations)} operations, longest "
                f"linearized prefix {len(k.linearized)}; first operations that could not follow it:"
            )
            lines += [f"    {op.describe()}  [{op.call}..{op.ret}]" for op in k.stuck[:6]]
        return "\n".join(lines)


class Model:
    """A sequential specification: ``init()`` the first state, ``step(state, op)`` the states after ``op``."""

    name = "model"

    def init(self) -> Hashable:
        raise NotImplementedError

    def step(self, state: Any, op: Operation) -> list[Hashable]:
        raise NotImplementedError

    def kills(self, op: Operation) -> Callable[[Operation], bool] | None:
        """For an operation that ends sessions: which pending operations it ends."""
        if op.kind == "end_session":
            ended = op.args["ended"]
            return lambda o: o.session == ended
        if op.kind == "crash":
            server = str(op.args["server"])
            return lambda o: session_server(o.session) == server
        return None


MAX_STEPS = 1_000_000  # per key: a search that needs more is reported undecided (a failure), not left running


def check_key(
    model: Model, operations: Sequence[Operation], key: str | None = None, max_steps: int = MAX_STEPS
) -> KeyResult:
    """Is this one partition linearizable?  (Exhaustive: the answer is exact, unless the search needs more
    than ``max_steps`` steps: then it says no, with ``undecided`` set.)"""
    ops = sorted(operations, key=lambda o: (o.call, o.id))
    index = {op.id: i for i, op in enumerate(ops)}
    events: list[_Entry] = []
    for op in ops:
        call = _Entry(op, True, op.call)
        ret = _Entry(op, False, op.end)
        call.match = ret
        events += [call, ret]
    # By time; on a tie a call comes before a return (they overlap: the weaker claim).
    events.sort(key=lambda e: (e.time, 0 if e.is_call else 1))
    head = _Entry(None, True, -1)
    prev = head
    for e in events:
        prev.next, e.prev = e, prev
        prev = e

    states: frozenset[Hashable] = frozenset([model.init()])
    linearized = 0
    cache: set[tuple[int, frozenset[Hashable]]] = {(0, states)}
    # Each choice: (call entry, states before, linearized before, entries lifted with it)
    calls: list[tuple[_Entry, frozenset[Hashable], int, list[_Entry]]] = []
    best: list[tuple[Operation, frozenset[Hashable]]] = []
    best_mask = 0
    trail: list[tuple[Operation, frozenset[Hashable]]] = []
    steps = 0
    entry = head.next
    while head.next is not None:
        assert entry is not None
        steps += 1
        if steps > max_steps:
            stuck = [o for o in ops if not (best_mask >> index[o.id]) & 1 and not o.indeterminate]
            return KeyResult(key, False, list(ops), [(o, tuple(s)) for o, s in best], stuck, steps, undecided=True)
        if entry.is_call:
            op = entry.op
            assert op is not None
            after = frozenset(s for state in states for s in model.step(state, op))
            if after:
                mask = linearized | (1 << index[op.id])
                lifted = [entry]
                ends = model.kills(op)
                if ends is not None:
                    # The pending operations of the sessions this one ends can no longer take effect.
                    e = head.next
                    while e is not None:
                        if e.is_call and e is not entry and e.op is not None and e.op.indeterminate and ends(e.op):
                            lifted.append(e)
                            mask |= 1 << index[e.op.id]
                        e = e.next
                if (mask, after) not in cache:
                    cache.add((mask, after))
                    calls.append((entry, states, linearized, lifted))
                    states, linearized = after, mask
                    for e in lifted:
                        _lift(e)
                    trail.append((op, after))
                    if len(trail) > len(best):
                        best, best_mask = list(trail), linearized
                    entry = head.next
                    continue
            entry = entry.next
        else:
            op = entry.op
            assert op is not None
            if op.indeterminate:
                # Every determinate operation is linearized: the pending ones never took effect.
                return KeyResult(key, True, list(ops), [(o, tuple(s)) for o, s in trail], [], steps)
            if not calls:
                stuck = [o for o in ops if not (best_mask >> index[o.id]) & 1 and not o.indeterminate]
                return KeyResult(key, False, list(ops), [(o, tuple(s)) for o, s in best], stuck, steps)
            top, states, linearized, lifted = calls.pop()
            trail.pop()
            for e in reversed(lifted):
                _unlift(e)
            entry = top.next
    return KeyResult(key, True, list(ops), [(o, tuple(s)) for o, s in trail], [], steps)


def check(model: Model | Callable[[str | None], Model], operations: Iterable[Operation]) -> Result:
    """Check each key's operations on its own (P-compositionality); keyless operations go to every key.

    ``model`` is a model, or a function of the key that makes one (keys with different parameters)."""
    operations = list(operations)
    shared = [o for o in operations if o.key is None]
    keys = sorted({o.key for o in operations if o.key is not None})
    results = []
    name = "model"
    for key in keys:
        m = model(key) if not isinstance(model, Model) else model
        name = m.name
        part = [o for o in operations if o.key == key] + shared
        results.append(check_key(m, part, key))
    return Result(all(r.ok for r in results), results, name)


# ---------------------------------------------------------------------------
# Models


def _alive(state_dead: frozenset[str], session: str) -> bool:
    return session not in state_dead and f"@{session_server(session)}" not in state_dead


def _ended(dead: frozenset[str], op: Operation) -> frozenset[str]:
    if op.kind == "end_session":
        return dead | {op.args["ended"]}
    return dead | {f"@{op.args['server']}"}


class KVModel(Model):
    """One key of the key-value store, with the ordering promise: every change takes a version
    greater than every version handed out before (also across a delete and a new set).

    State: (value or None when absent, version of the entry or None when unknown, floor): the
    current version is known, or only known to exceed ``floor``; a new version must exceed
    ``floor``.  Operations: ``get`` -> [value, version] or None; ``set`` (args value) -> version;
    ``cas`` (args value, expected; 0: must be absent) -> version or None; ``delete`` -> bool.
    With ``versions_grow=False`` the model forgets the promise (a control for the tests).
    """

    name = "kv"

    def __init__(self, versions_grow: bool = True) -> None:
        self.versions_grow = versions_grow
        self.name = "kv" if versions_grow else "kv (versions unordered)"

    def init(self) -> Hashable:
        return (None, None, 0)

    def _fresh(self, floor: int, version: Any) -> bool:
        return isinstance(version, int) and (version > floor or not self.versions_grow)

    def step(self, state: Any, op: Operation) -> list[Hashable]:
        value, version, floor = state
        out = op.output
        if op.kind in GLOBAL_KINDS:
            return [state]
        if op.kind == "get":
            if out is UNKNOWN:
                return [state]
            if out is None:
                return [state] if value is None else []
            got_value, got_version = out
            if value is None or got_value != value:
                return []
            if version is None:  # known only to exceed floor: now known
                return [(value, got_version, got_version)] if self._fresh(floor, got_version) else []
            return [state] if got_version == version else []
        if op.kind == "set":
            if out is UNKNOWN:
                return [(op.args["value"], None, floor)]
            return [(op.args["value"], out, out if self.versions_grow else 0)] if self._fresh(floor, out) else []
        if op.kind == "cas":
            expected = op.args["expected"]
            if expected == 0:
                may_match, may_differ = value is None, value is not None
            elif version is None:
                may_match = value is not None and (expected > floor or not self.versions_grow)
                may_differ = True
            else:
                may_match, may_differ = (
                    value is not None and version == expected,
                    not (value is not None and version == expected),
                )
            new_floor = max(floor, expected) if self.versions_grow else 0
            if out is UNKNOWN:
                return ([(op.args["value"], None, new_floor)] if may_match else []) + ([state] if may_differ else [])
            if out is None:
                return [state] if may_differ else []
            if not may_match or not self._fresh(new_floor, out):
                return []
            return [(op.args["value"], out, out if self.versions_grow else 0)]
        if op.kind == "delete":
            gone = (None, None, floor if version is None else version) if value is not None else state
            if out is UNKNOWN:
                return [gone]
            return [gone] if bool(out) == (value is not None) else []
        raise ValueError(f"kv: unknown operation {op.kind}")


class CounterModel(Model):
    """One counter: ``add`` (args delta) -> new value; ``get`` -> value; ``set`` (args value,
    expected or None) -> bool.  State: the value (an absent counter is 0)."""

    name = "counter"

    def init(self) -> Hashable:
        return 0

    def step(self, state: Any, op: Operation) -> list[Hashable]:
        out = op.output
        if op.kind in GLOBAL_KINDS:
            return [state]
        if op.kind == "add":
            new = state + op.args["delta"]
            return [new] if out is UNKNOWN or out == new else []
        if op.kind == "get":
            return [state] if out is UNKNOWN or out == state else []
        if op.kind == "set":
            expected = op.args.get("expected")
            match = expected is None or expected == state
            if out is UNKNOWN:
                return [op.args["value"]] if match else [state]
            if bool(out) != match:
                return []
            return [op.args["value"]] if match else [state]
        raise ValueError(f"counter: unknown operation {op.kind}")


def _holds_of(holds: frozenset[tuple[str, Any, int]], session: str, what: Any) -> int:
    for s, w, n in holds:
        if s == session and w == what:
            return n
    return 0


def _change(
    holds: frozenset[tuple[str, Any, int]], session: str, what: Any, by: int
) -> frozenset[tuple[str, Any, int]]:
    n = _holds_of(holds, session, what)
    rest = holds - {(session, what, n)}
    return rest | {(session, what, n + by)} if n + by > 0 else rest


class LockModel(Model):
    """One named lock, session scope, as PostgreSQL's advisory locks: exclusive and shared modes,
    stacking (acquired twice, held until released twice), a session's own holds never conflict
    with its requests, and a session's holds end with it.

    ``acquire`` (args shared) -> bool: true takes a hold; false only while another session holds a
    conflicting one (whatever the wait: a timed wait that returns false must not have taken the
    lock), or, for a shared request, any hold (an exclusive request may be queued ahead of it).
    ``release`` (args shared) -> bool: true gives one hold back, false when there is none.
    State: (frozenset of (session, shared, count), ended sessions and servers).
    """

    name = "lock"

    def init(self) -> Hashable:
        return (frozenset(), frozenset())

    def step(self, state: Any, op: Operation) -> list[Hashable]:
        holds, dead = state
        out = op.output
        if op.kind in GLOBAL_KINDS:
            ended = _ended(dead, op)
            return [(frozenset(h for h in holds if _alive(ended, h[0])), ended)]
        if not _alive(dead, op.session):
            return []
        shared = bool(op.args.get("shared", False))
        if op.kind == "acquire":
            conflict = any(s != op.session and (not shared or not sh) for s, sh, _ in holds)
            # PostgreSQL queues requests: while another session holds the lock shared, an
            # exclusive request may be waiting, and a new shared request then queues behind it
            # (fails to try).  Unseen, so either outcome.  (Not for a mode this session holds:
            # that is granted at once.)
            queued = shared and _holds_of(holds, op.session, shared) == 0 and any(s != op.session for s, _, _ in holds)
            taken = (_change(holds, op.session, shared, 1), dead)
            if out is UNKNOWN:
                return [state] if conflict else [state, taken] if queued else [taken]
            if out:
                return [] if conflict else [taken]
            return [state] if conflict or queued else []
        if op.kind == "release":
            held = _holds_of(holds, op.session, shared) > 0
            after = (_change(holds, op.session, shared, -1), dead) if held else state
            if out is UNKNOWN or bool(out) == held:
                return [after]
            return []
        raise ValueError(f"lock: unknown operation {op.kind}")


class SemaphoreModel(Model):
    """One semaphore of ``limit`` permits, each a session-scope advisory lock.

    ``acquire`` -> a permit number or None: a number only of a permit no other session holds
    (its own: stacked); None always allowed: a failed acquire is *not* linearizable (it tries
    the permits one after another, so a permit freed and taken again between two tries is
    missed; sql/README.md says so).  ``release`` -> bool: gives back this session's
    highest-numbered permit.  At most ``limit`` holders follows.
    """

    name = "semaphore"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def init(self) -> Hashable:
        return (frozenset(), frozenset())

    def step(self, state: Any, op: Operation) -> list[Hashable]:
        holds, dead = state
        out = op.output
        if op.kind in GLOBAL_KINDS:
            ended = _ended(dead, op)
            return [(frozenset(h for h in holds if _alive(ended, h[0])), ended)]
        if not _alive(dead, op.session):
            return []
        if op.kind == "acquire":
            free = [p for p in range(1, self.limit + 1) if not any(s != op.session and w == p for s, w, _ in holds)]
            if out is UNKNOWN:
                return [state] + [(_change(holds, op.session, p, 1), dead) for p in free]
            if out is None:
                return [state]
            return [(_change(holds, op.session, out, 1), dead)] if out in free else []
        if op.kind == "release":
            mine = sorted((w for s, w, _ in holds if s == op.session), reverse=True)
            after = (_change(holds, op.session, mine[0], -1), dead) if mine else state
            if out is UNKNOWN or bool(out) == bool(mine):
                return [after]
            return []
        raise ValueError(f"semaphore: unknown operation {op.kind}")


class LeaseModel(Model):
    """One broker lease (session leases): ``claim`` -> an epoch greater than every epoch handed
    out before, or 'held' (55P03: another session holds it); ``release`` -> bool (true when this
    session held it).  State: (holder session or None, floor of the next epoch, ended)."""

    name = "lease"

    def init(self) -> Hashable:
        return (None, 0, frozenset())

    def step(self, state: Any, op: Operation) -> list[Hashable]:
        holder, floor, dead = state
        out = op.output
        if op.kind in GLOBAL_KINDS:
            ended = _ended(dead, op)
            return [(holder if holder is not None and _alive(ended, holder) else None, floor, ended)]
        if not _alive(dead, op.session):
            return []
        if op.kind == "claim":
            held = holder is not None and holder != op.session
            if holder == op.session:
                return [state] if out in (UNKNOWN, "already held") else []
            if out is UNKNOWN:
                return [state] if held else [(op.session, floor, dead)]
            if out == "held":
                return [state] if held else []
            if held or not isinstance(out, int) or out <= floor:
                return []
            return [(op.session, out, dead)]
        if op.kind == "release":
            mine = holder == op.session
            after = (None, floor, dead) if mine else state
            return [after] if out is UNKNOWN or bool(out) == mine else []
        raise ValueError(f"lease: unknown operation {op.kind}")


# ---------------------------------------------------------------------------
# Artifacts: the history and a picture of it


def artifacts_dir(name: str) -> Path:
    """$PGBROKER_ARTIFACTS/<name> (CI uploads it), else a new temporary directory."""
    root = os.environ.get("PGBROKER_ARTIFACTS")
    if root:
        path = Path(root) / name
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=f"pgbroker-linearizability-{name}-"))


def write_artifacts(result: Result, operations: Sequence[Operation], name: str) -> Path:
    """Write history.json and history.html for a check; returns the directory."""
    directory = artifacts_dir(name)
    (directory / "history.json").write_text(
        json.dumps(
            {
                "model": result.model,
                "linearizable": result.ok,
                "failing_keys": [k.key for k in result.failures],
                "operations": [o.to_json() for o in operations],
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    (directory / "history.html").write_text(render_html(result, operations, name), encoding="utf-8")
    return directory


def render_html(result: Result, operations: Sequence[Operation], title: str) -> str:
    """Porcupine's picture: per key, one row per client, a bar per operation from its invocation to
    its return (an indeterminate one runs to the right edge, hatched); the longest linearized
    prefix numbered in order, the operations that could not follow it in red."""
    parts = [
        "<!doctype html><meta charset=utf-8><title>",
        html.escape(title),
        "</title><style>body{font:13px sans-serif}.row{position:relative;height:22px;border-bottom:1px solid #eee}"
        ".lbl{position:absolute;left:0;width:150px;overflow:hidden;white-space:nowrap}"
        ".op{position:absolute;height:16px;top:2px;border-radius:3px;font-size:10px;overflow:hidden;"
        "white-space:nowrap;background:#9ecae1;border:1px solid #3182bd;box-sizing:border-box}"
        ".op.lin{background:#a1d99b;border-color:#31a354}.op.stuck{background:#fc9272;border-color:#de2d26}"
        ".op.unk{background:repeating-linear-gradient(45deg,#ddd,#ddd 4px,#fff 4px,#fff 8px)}"
        ".op.glob{background:#fdd0a2;border-color:#e6550d}</style>",
        f"<h1>{html.escape(title)}: {html.escape(result.summary().splitlines()[0])}</h1>",
        "<p>Green: in the longest linearized prefix (number: its place); red: could not follow it; "
        "hatched: indeterminate (killed in flight); orange: a session ended or the server crashed. "
        "Hover a bar for the call.</p>",
    ]
    keyed = result.failures or result.keys
    for kr in keyed:
        ops = kr.operations
        if not ops:
            continue
        t0 = min(o.call for o in ops)
        t1 = max(max((o.ret for o in ops if o.ret is not None), default=t0), max(o.call for o in ops)) + 1
        span = max(t1 - t0, 1)
        width = 1400
        order = {o.id: i + 1 for i, (o, _) in enumerate(kr.linearized)}
        states = {o.id: s for o, s in kr.linearized}
        stuck = {o.id for o in kr.stuck}
        clients = sorted({o.client for o in ops})
        parts.append(f"<h2>key {html.escape(repr(kr.key))}: {'linearizable' if kr.ok else 'NOT linearizable'}</h2>")
        parts.append(f"<div style='position:relative;width:{width + 160}px'>")
        for c in clients:
            parts.append(f"<div class=row><span class=lbl>{html.escape(c)}</span>")
            for o in ops:
                if o.client != c:
                    continue
                left = 150 + (o.call - t0) * width // span
                right = 150 + ((o.ret if o.ret is not None else t1) - t0) * width // span
                cls = "op"
                if o.kind in GLOBAL_KINDS:
                    cls += " glob"
                elif o.indeterminate:
                    cls += " unk"
                if o.id in order:
                    cls += " lin"
                if o.id in stuck:
                    cls += " stuck"
                tip = f"{o.describe()} session {o.session} [{o.call - t0} .. "
                tip += f"{'never' if o.ret is None else o.ret - t0}] ns"
                if o.id in states:
                    tip += f"; states after: {states[o.id]!r}"
                label = (f"{order[o.id]}: " if o.id in order else "") + o.kind
                parts.append(
                    f"<div class='{cls}' style='left:{left}px;width:{max(right - left, 3)}px' "
                    f"title='{html.escape(tip, quote=True)}'>{html.escape(label)}</div>"
                )
            parts.append("</div>")
        parts.append("</div>")
        if not kr.ok:
            parts.append("<h3>Longest linearized prefix</h3><ol>")
            parts += [f"<li>{html.escape(o.describe())} &rarr; {html.escape(repr(s))}</li>" for o, s in kr.linearized]
            parts.append("</ol><h3>Could not follow it</h3><ul>")
            parts += [f"<li>{html.escape(o.describe())}</li>" for o in kr.stuck]
            parts.append("</ul>")
    return "".join(parts)


def assert_linearizable(
    model: Model | Callable[[str | None], Model], operations: Sequence[Operation], name: str
) -> Result:
    """Check; on failure save the history and its picture and fail naming where they are."""
    result = check(model, operations)
    if not result.ok:
        where = write_artifacts(result, operations, name)
        raise AssertionError(
            f"{result.summary()}\nhistory and visualisation: {where / 'history.json'}, {where / 'history.html'}"
        )
    return result

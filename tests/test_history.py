"""The history checker itself, on hand-made histories: each kind of violation is
found, and correct histories (including unknown outcomes) pass."""

from __future__ import annotations

import itertools
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
from history import (
    FOREVER,
    OK,
    UNKNOWN,
    History,
    Hold,
    Op,
    Unresolved,
    check_cas,
    check_counter,
    check_exclusion,
    check_fencing,
    check_lease_history,
    check_locks,
    check_semaphore,
    check_tokens,
    lease_holds,
    now_ns,
)

_seq = itertools.count(1)


def op(process: str, name: str, key: str | None, invoke: int, complete: int | None, result: str = OK, **kw: Any) -> Op:
    return Op(process, name, key, invoke, complete, result, kw.get("args", {}), kw.get("values", {}), next(_seq))


def acq(p: str, t0: int, t1: int | None, shared: bool = False, acquired: bool = True, result: str = OK) -> Op:
    return op(p, "acquire", "L", t0, t1, result, args={"shared": shared}, values={"acquired": acquired})


def rel(p: str, t0: int, t1: int, shared: bool = False, released: bool = True) -> Op:
    return op(p, "release", "L", t0, t1, args={"shared": shared}, values={"released": released})


def kinds(violations: list) -> list[str]:
    return [v.kind for v in violations]


# ---------------------------------------------------------------------------
# Recording


def _child(directory: str) -> None:
    with History(directory).recorder("child") as rec, rec.call("add", "c", delta=1) as c:
        c.ok(value=1)


def test_recorder_round_trip_across_processes(tmp_path: Path) -> None:
    history = History(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_child, args=(str(tmp_path),))
    before = now_ns()
    child.start()
    child.join(30)
    assert child.exitcode == 0
    with history.recorder("parent") as rec:
        with rec.call("acquire", "L", shared=False) as c:
            c.ok(acquired=True)
        with pytest.raises(ConnectionError), rec.call("release", "L") as c:
            raise ConnectionError("reset")
        with rec.call("cas", "k", expected=3) as c:
            c.fail(error="22023")
        rec._write({"kind": "invoke", "seq": 99, "t": now_ns(), "op": "add", "key": "c", "args": {"delta": 5}})
    with (tmp_path / "parent.jsonl").open("a") as f:
        f.write('{"kind": "compl')  # torn last line of a killed process
    ops = history.load()
    assert [(o.process, o.op, o.result) for o in ops] == [
        ("child", "add", OK),
        ("parent", "acquire", OK),
        ("parent", "release", UNKNOWN),
        ("parent", "cas", "failed"),
        ("parent", "add", UNKNOWN),
    ]
    assert ops[0].values == {"value": 1} and ops[0].args == {"delta": 1}
    assert before < ops[0].invoke < ops[0].complete < ops[1].invoke  # one clock for both processes
    assert "ConnectionError: reset" in ops[2].values["error"]
    assert ops[4].complete is None and ops[4].end == FOREVER


def test_call_without_outcome_is_an_error(tmp_path: Path) -> None:
    with History(tmp_path).recorder("p") as rec, pytest.raises(RuntimeError, match="neither"), rec.call("x"):
        pass


# ---------------------------------------------------------------------------
# Locks


def test_locks_correct_history_passes() -> None:
    ops = [
        acq("a", 0, 10), rel("a", 20, 21),
        acq("b", 5, 25), rel("b", 30, 31),  # waited for a
        acq("c", 40, 41, shared=True), acq("d", 40, 42, shared=True),
        rel("c", 50, 51, shared=True), rel("d", 52, 53, shared=True),
        acq("a", 45, 60), rel("a", 61, 62),
        acq("b", 63, 64, acquired=False),  # timed out: holds nothing
        acq("c", 63, 70),  # never released: held to the end
    ]  # fmt: skip
    assert check_locks(ops) == []


def test_exclusive_overlap_is_found() -> None:
    ops = [acq("a", 0, 10), rel("a", 20, 21), acq("b", 5, 15), rel("b", 30, 31)]
    violations = check_locks(ops)
    assert kinds(violations) == ["exclusive-overlap"]
    assert "'L': a [10..20] overlaps b [15..30] by 5 ns" in str(violations[0])
    assert len(violations[0].ops) == 4  # both acquires and both releases, to debug with


def test_shared_overlapping_exclusive_is_found_but_shared_with_shared_is_not() -> None:
    ops = [acq("a", 0, 10, shared=True), rel("a", 20, 21, shared=True), acq("b", 5, 15), rel("b", 30, 31)]
    assert kinds(check_locks(ops)) == ["shared-exclusive-overlap"]
    ops = [acq("a", 0, 10, shared=True), rel("a", 20, 21, shared=True)]
    ops += [acq("b", 5, 15, shared=True), rel("b", 30, 31, shared=True)]
    assert check_locks(ops) == []


def test_stacked_holds_end_at_the_last_release() -> None:
    # a acquires twice, releases once at 20: still holding when b gets it at 25.
    ops = [acq("a", 0, 1), acq("a", 2, 3), rel("a", 20, 21), acq("b", 5, 25), rel("a", 30, 31), rel("b", 40, 41)]
    assert kinds(check_locks(ops)) == ["exclusive-overlap"]


def test_unknown_acquire_is_unresolved_not_a_violation() -> None:
    unresolved = Unresolved()
    ops = [acq("a", 0, None, result=UNKNOWN), acq("b", 5, 15), rel("b", 30, 31)]
    assert check_locks(ops, unresolved) == []
    assert [o.process for o in unresolved.ops] == ["a"]


def test_release_refused_while_held_is_found() -> None:
    assert kinds(check_locks([acq("a", 0, 1), rel("a", 5, 6, released=False)])) == ["release-refused"]


def test_bad_interval_is_found() -> None:
    assert kinds(check_exclusion([Hold("a", "r", 10, 5)])) == ["bad-interval"]


# ---------------------------------------------------------------------------
# Semaphores


def sacq(p: str, t0: int, t1: int | None, permit: Any) -> Op:
    return op(p, "acquire", "S", t0, t1, args={"limit": 3}, values={"permit": permit})


def srel(p: str, t0: int, t1: int) -> Op:
    return op(p, "release", "S", t0, t1, values={"released": True})


def test_semaphore_correct_history_passes() -> None:
    ops = [
        sacq("a", 0, 1, 1), sacq("b", 0, 2, 2), sacq("c", 0, 3, 3),
        sacq("d", 0, 15, 2),  # waited until b released
        srel("b", 10, 11), srel("a", 20, 21), srel("c", 20, 21), srel("d", 30, 31),
        sacq("e", 0, 5, None),  # timed out
    ]  # fmt: skip
    assert check_semaphore(ops, limit=3) == []


def test_semaphore_over_limit_is_found() -> None:
    ops = [sacq("a", 0, 1, 1), sacq("b", 0, 2, 2), sacq("c", 0, 3, 3), sacq("d", 0, 4, 1), srel("a", 0, 0)]
    ops[-1] = srel("a", 10, 11)
    found = check_semaphore(ops, limit=3)
    assert sorted(kinds(found)) == ["over-limit", "permit-shared"]
    over = next(v for v in found if v.kind == "over-limit")
    assert "4 holders > limit 3 at 4" in over.message and "d (permit 1)" in over.message


def test_semaphore_permit_out_of_range_is_found() -> None:
    assert kinds(check_semaphore([sacq("a", 0, 1, 4)], limit=3)) == ["permit-out-of-range"]
    assert kinds(check_semaphore([sacq("a", 0, 1, 0)], limit=3)) == ["permit-out-of-range"]


def test_semaphore_one_holder_per_permit() -> None:
    ops = [sacq("a", 0, 1, 2), sacq("b", 0, 5, 2), srel("a", 10, 11), srel("b", 12, 13)]
    assert kinds(check_semaphore(ops, limit=3)) == ["permit-shared"]


# ---------------------------------------------------------------------------
# Counters


def add(p: str, t0: int, t1: int | None, value: int | None, delta: int = 1, result: str = OK) -> Op:
    return op(p, "add", "n", t0, t1, result, args={"delta": delta}, values={} if value is None else {"value": value})


def test_counter_correct_history_passes() -> None:
    ops = [add("a", 0, 5, 1), add("b", 1, 6, 2), add("a", 7, 8, 3), add("b", 9, None, None, result=UNKNOWN)]
    assert check_counter(ops, final=3) == []
    assert check_counter(ops, final=4) == []  # the unknown one took effect: allowed too


def test_counter_lost_and_phantom_updates_are_found() -> None:
    ops = [add("a", 0, 5, 1), add("b", 1, 6, 2), add("a", 7, 8, 3)]
    lost = check_counter(ops, final=2)
    assert kinds(lost) == ["lost-update"] and "final 2, but initial 0 + 3 acknowledged adds = 3" in lost[0].message
    assert kinds(check_counter(ops, final=5)) == ["phantom-update"]


def test_counter_duplicate_and_real_time_order_are_found() -> None:
    assert "duplicate-value" in kinds(check_counter([add("a", 0, 5, 1), add("b", 1, 6, 1)], final=2))
    # b's add completed (returned 1) before a's was invoked, yet a returned the smaller value.
    assert kinds(check_counter([add("b", 0, 2, 2), add("a", 5, 6, 1)], final=2)) == ["real-time-order"]


# ---------------------------------------------------------------------------
# Compare-and-set


def cas(p: str, t0: int, t1: int | None, expected: int, new: int | None, result: str = OK) -> Op:
    return op(p, "cas", "k", t0, t1, result, args={"expected": expected}, values={"new": new})


def test_cas_chain_passes() -> None:
    ops = [cas("a", 0, 2, 5, 7), cas("b", 1, 3, 5, None), cas("b", 4, 6, 7, 9), cas("a", 5, 8, 9, 10)]
    assert check_cas(ops, initial=5, final=10) == []


def test_cas_lost_update_is_found() -> None:
    ops = [cas("a", 0, 2, 5, 7), cas("b", 1, 3, 5, 8)]
    assert kinds(check_cas(ops, initial=5, final=8)) == ["lost-update", "chain-broken"]


def test_cas_chain_broken_and_final_mismatch_are_found() -> None:
    ops = [cas("a", 0, 2, 5, 7), cas("b", 3, 4, 6, 9)]  # b named 6, which no write made
    found = check_cas(ops, initial=5, final=9)
    assert kinds(found) == ["chain-broken"] and "named 6 but the previous successful write made 7" in found[0].message
    assert kinds(check_cas([cas("a", 0, 2, 5, 7)], initial=5, final=8)) == ["final-mismatch"]
    assert kinds(check_cas([cas("a", 0, 2, 5, 5)], initial=5, final=5)) == ["version-not-changed"]


def test_cas_unknown_outcome_may_bridge_the_chain() -> None:
    # a's CAS on 7 has an unknown outcome; b then succeeded naming 8 (which a wrote, unacknowledged).
    ops = [cas("x", 0, 1, 5, 7), cas("a", 2, None, 7, None, result=UNKNOWN), cas("b", 3, 4, 8, 9)]
    assert check_cas(ops, initial=5, final=9) == []


def test_cas_real_time_order_is_found() -> None:
    ops = [cas("a", 5, 6, 3, 4), cas("b", 0, 1, 1, 3), cas("c", 0, 2, 4, 6)]
    # c wrote 6 and completed at 2, before a (which wrote 4, the version c named) was invoked.
    assert "real-time-order" in kinds(check_cas(ops, initial=1, final=6))


# ---------------------------------------------------------------------------
# Leases


def claim(p: str, t0: int, t1: int | None, token: int | None, result: str = OK) -> Op:
    return op(p, "claim", "lease", t0, t1, result, values={"token": token})


def write(p: str, t0: int, t1: int, token: int, result: str = OK) -> Op:
    return op(p, "write", "lease", t0, t1, result, args={"token": token})


def test_tokens_unique_and_increasing() -> None:
    assert check_tokens([claim("a", 0, 1, 1), claim("b", 2, 3, 2), claim("a", 2, 3, 1)]) == []  # a re-claims 1
    assert kinds(check_tokens([claim("a", 0, 1, 1), claim("b", 2, 3, 1)])) == ["token-reused"]
    assert kinds(check_tokens([claim("a", 0, 1, 5), claim("b", 2, 3, 4)])) == ["real-time-order"]


def test_fenced_write_after_a_newer_claim_is_found() -> None:
    ok = [claim("a", 0, 1, 1), write("a", 2, 3, 1), claim("b", 2, 5, 2), write("a", 4, 6, 1, result="failed")]
    assert check_fencing(ok) == []
    # a's write with token 1 was invoked at 6, after b's claim of 2 completed at 5, and was accepted.
    bad = [claim("a", 0, 1, 1), claim("b", 2, 5, 2), write("a", 6, 7, 1)]
    found = check_fencing(bad)
    assert kinds(found) == ["fenced-write-accepted"] and "token 1 accepted after token 2" in found[0].message


def test_lease_holders_never_overlap() -> None:
    ops = [claim("a", 0, 1, 1), op("a", "release", "lease", 10, 11), claim("b", 5, 12, 2)]
    assert check_exclusion(lease_holds(ops)) == []
    ops = [claim("a", 0, 1, 1), op("a", "release", "lease", 10, 11), claim("b", 5, 8, 2)]  # b before a released
    holds = lease_holds(ops)
    assert kinds(check_exclusion(holds)) == ["exclusive-overlap"]


def row(i: int, epoch: int, event: str = "claim", name: str = "lease") -> dict[str, Any]:
    return {"id": i, "name": name, "epoch": epoch, "event": event}


def test_lease_history_rows() -> None:
    rows = [row(1, 1), row(2, 1, "release"), row(3, 2), row(4, 3, "takeover"), row(5, 1, name="other")]
    assert check_lease_history(rows, [claim("a", 0, 1, 1), claim("b", 2, 3, 3)]) == []
    assert kinds(check_lease_history([row(1, 1), row(2, 1)])) == ["epoch-reused"]
    assert kinds(check_lease_history([row(1, 2), row(2, 1)])) == ["epoch-not-increasing"]
    assert kinds(check_lease_history([row(1, 1), row(2, 2, "release")])) == ["release-unclaimed"]
    assert kinds(check_lease_history(rows, [claim("a", 0, 1, 7)])) == ["claim-not-in-history"]

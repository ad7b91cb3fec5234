"""The linearizability checker (tests/linearizability.py) itself, on hand-made histories: it
accepts histories known to be linearizable (concurrent calls in either order, indeterminate calls
that took effect late or never) and rejects planted faults (a version that goes down, a lock
result flipped, a stale read, a permit given twice, an epoch reused); the artifacts of a failure.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from history import OK, History
from history import UNKNOWN as UNKNOWN_RESULT
from linearizability import (
    UNKNOWN,
    CounterModel,
    KVModel,
    LeaseModel,
    LockModel,
    Operation,
    SemaphoreModel,
    assert_linearizable,
    check,
    check_key,
    from_history,
    write_artifacts,
)

_ids = itertools.count()


def o(
    client: str, kind: str, call: int, ret: int | None, output: Any = UNKNOWN, key: str | None = "k", **args: Any
) -> Operation:
    session = args.pop("session", f"{client}@s0")
    return Operation(next(_ids), client, session, kind, key, args, call, ret, output)


def kill(session: str, call: int, ret: int) -> Operation:
    return o("killer", "end_session", call, ret, None, key=None, ended=session)


# ---------------------------------------------------------------------------
# Key-value store


def test_kv_sequential_history_is_linearizable() -> None:
    ops = [
        o("a", "set", 0, 1, 5, value="x"),
        o("b", "get", 2, 3, ["x", 5]),
        o("a", "cas", 4, 5, 9, value="y", expected=5),
        o("b", "cas", 6, 7, None, value="z", expected=5),
        o("a", "delete", 8, 9, True),
        o("b", "get", 10, 11, None),
        o("a", "set", 12, 13, 12, value="w"),
    ]
    assert check(KVModel(), ops).ok


def test_kv_concurrent_writes_may_be_linearized_either_way() -> None:
    # b's set overlaps a's and got the smaller version: it took effect first.
    ops = [o("a", "set", 0, 10, 7, value="x"), o("b", "set", 1, 9, 6, value="y"), o("c", "get", 11, 12, ["x", 7])]
    assert check(KVModel(), ops).ok


def test_kv_version_going_down_is_rejected_and_only_by_the_ordering_promise() -> None:
    # The example: versions 1, 2, 4, then 3 for a call that started before the 4.
    ops = [
        o("a", "set", 0, 1, 1, value="v1"),
        o("a", "set", 2, 3, 2, value="v2"),
        o("b", "set", 4, 20, 3, value="v3"),
        o("c", "set", 5, 6, 4, value="v4"),
        o("d", "get", 21, 22, ["v3", 3]),
    ]
    result = check(KVModel(), ops)
    assert not result.ok and result.failures[0].key == "k"
    assert check(KVModel(versions_grow=False), ops).ok


def test_kv_set_after_a_delete_with_a_smaller_version_is_rejected() -> None:
    ops = [
        o("a", "set", 0, 1, 8, value="x"),
        o("a", "delete", 2, 3, True),
        o("b", "set", 4, 5, 6, value="y"),
    ]
    assert not check(KVModel(), ops).ok


def test_kv_stale_read_is_rejected() -> None:
    ops = [o("a", "set", 0, 1, 1, value="x"), o("a", "set", 2, 3, 2, value="y"), o("b", "get", 4, 5, ["x", 1])]
    assert not check(KVModel(), ops).ok


def test_kv_indeterminate_write_may_take_effect_late_or_never() -> None:
    late = [
        o("a", "set", 0, None, value="lost"),
        o("b", "get", 5, 6, None),
        o("b", "get", 7, 8, ["lost", 3]),
    ]
    assert check(KVModel(), late).ok
    never = [o("a", "set", 0, None, value="lost"), o("b", "set", 5, 6, 4, value="y"), o("b", "get", 7, 8, ["y", 4])]
    assert check(KVModel(), never).ok


def test_kv_indeterminate_write_cannot_take_effect_after_its_session_ended() -> None:
    ops = [
        o("a", "set", 0, None, value="lost", session="a@s0"),
        kill("a@s0", 2, 3),
        o("b", "get", 5, 6, None),
        o("b", "get", 7, 8, ["lost", 3]),
    ]
    assert not check(KVModel(), ops).ok


def test_keys_are_checked_apart() -> None:
    ops = [o("a", "set", 0, 10, 2, key="k1", value="x"), o("b", "set", 1, 2, 1, key="k2", value="y")]
    result = check(KVModel(), ops)
    assert result.ok and [k.key for k in result.keys] == ["k1", "k2"]


# ---------------------------------------------------------------------------
# Counters


def test_counter_concurrent_adds_and_a_lost_update() -> None:
    ok = [o("a", "add", 0, 5, 2, delta=1), o("b", "add", 1, 4, 1, delta=1), o("c", "get", 6, 7, 2)]
    assert check(CounterModel(), ok).ok
    lost = [o("a", "add", 0, 5, 1, delta=1), o("b", "add", 1, 4, 1, delta=1)]
    assert not check(CounterModel(), lost).ok


def test_counter_set_with_expected() -> None:
    ops = [
        o("a", "add", 0, 1, 3, delta=3),
        o("b", "set", 2, 3, True, value=10, expected=3),
        o("c", "set", 4, 5, False, value=0, expected=3),
        o("c", "get", 6, 7, 10),
    ]
    assert check(CounterModel(), ops).ok
    flipped = [*ops[:2], o("c", "set", 4, 5, True, value=0, expected=3)]
    assert not check(CounterModel(), flipped).ok


# ---------------------------------------------------------------------------
# Locks


def test_lock_contention_is_linearizable() -> None:
    ops = [
        o("a", "acquire", 0, 1, True),
        o("b", "acquire", 2, 30, True),  # waited for a's release
        o("c", "acquire", 3, 4, False),
        o("a", "release", 10, 11, True),
        o("b", "release", 31, 32, True),
        o("c", "acquire", 33, 34, True),
    ]
    assert check(LockModel(), ops).ok


def test_lock_timed_wait_false_while_holding_is_rejected() -> None:
    # The bug of issue 41: b's timed wait returns false, yet b holds the lock (c cannot get it).
    ops = [
        o("a", "acquire", 0, 1, True),
        o("b", "acquire", 2, 12, False, wait="10 ms"),
        o("a", "release", 11, 12, True),
        o("c", "acquire", 20, 21, False),
    ]
    assert not check(LockModel(), ops).ok
    # ... while a false that a holder explains is fine.
    assert check(LockModel(), ops[:3]).ok


def test_lock_flipped_result_is_rejected() -> None:
    ops = [o("a", "acquire", 0, 1, True), o("b", "acquire", 2, 3, True)]
    assert not check(LockModel(), ops).ok


def test_lock_of_a_killed_session_is_freed() -> None:
    ops = [
        o("a", "acquire", 0, 1, True, session="a@s0"),
        kill("a@s0", 5, 9),
        o("b", "acquire", 6, 8, False),  # before a's backend exited
        o("b", "acquire", 10, 11, True),
    ]
    assert check(LockModel(), ops).ok
    assert not check(LockModel(), [*ops[:2], o("b", "acquire", 10, 11, False)]).ok


def test_lock_indeterminate_acquire_may_have_taken_it() -> None:
    ops = [
        o("a", "acquire", 0, None, session="a@s0"),
        o("b", "acquire", 5, 6, False),  # a's acquire took it
        kill("a@s0", 7, 8),
        o("b", "acquire", 10, 11, True),
    ]
    assert check(LockModel(), ops).ok


def test_lock_crash_frees_every_session_of_the_server() -> None:
    ops = [
        o("a", "acquire", 0, 1, True, session="1@s0"),
        o("killer", "crash", 2, 5, None, key=None, server="s0"),
        o("b", "acquire", 6, 7, True, session="2@s1"),
    ]
    assert check(LockModel(), ops).ok
    held_by_survivor = [
        *ops[:2],
        o("b", "acquire", 6, 7, True, session="2@s1"),
        o("c", "acquire", 8, 9, True, session="3@s1"),
    ]
    assert not check(LockModel(), held_by_survivor).ok


def test_shared_locks() -> None:
    ops = [
        o("a", "acquire", 0, 1, True, shared=True),
        o("b", "acquire", 2, 3, True, shared=True),
        o("c", "acquire", 4, 5, False, shared=False),
        o("a", "release", 6, 7, True, shared=True),
        o("b", "release", 8, 9, True, shared=True),
        o("c", "acquire", 10, 11, True, shared=False),
    ]
    assert check(LockModel(), ops).ok
    bad = [*ops[:2], o("c", "acquire", 4, 5, True, shared=False)]
    assert not check(LockModel(), bad).ok


def test_lock_stacks() -> None:
    ops = [
        o("a", "acquire", 0, 1, True),
        o("a", "acquire", 2, 3, True),
        o("a", "release", 4, 5, True),
        o("b", "acquire", 6, 7, False),
        o("a", "release", 8, 9, True),
        o("a", "release", 10, 11, False),
    ]
    assert check(LockModel(), ops).ok


# ---------------------------------------------------------------------------
# Semaphores and leases


def test_semaphore_permits() -> None:
    ops = [
        o("a", "acquire", 0, 1, 1),
        o("b", "acquire", 2, 3, 2),
        o("c", "acquire", 4, 5, None),
        o("a", "release", 6, 7, True),
        o("c", "acquire", 8, 9, 1),
    ]
    assert check(SemaphoreModel(2), ops).ok
    twice = [*ops[:2], o("c", "acquire", 4, 5, 1)]
    assert not check(SemaphoreModel(2), twice).ok
    out_of_range = [o("a", "acquire", 0, 1, 3)]
    assert not check(SemaphoreModel(2), out_of_range).ok


def test_lease_epochs_grow_and_holders_exclude() -> None:
    ops = [
        o("a", "claim", 0, 1, 5),
        o("b", "claim", 2, 3, "held"),
        o("a", "release", 4, 5, True),
        o("b", "claim", 6, 7, 6),
    ]
    assert check(LeaseModel(), ops).ok
    reused = [*ops[:3], o("b", "claim", 6, 7, 5)]
    assert not check(LeaseModel(), reused).ok
    two_holders = [ops[0], o("b", "claim", 2, 3, 9)]
    assert not check(LeaseModel(), two_holders).ok


# ---------------------------------------------------------------------------
# The search, recordings and artifacts


def test_search_is_exhaustive_on_a_wide_window() -> None:
    # 10 concurrent adds with distinct results: one order of 10! works; memoisation finds it.
    ops = [o(f"c{i}", "add", 0, 100, i + 1, delta=1) for i in reversed(range(10))]
    result = check_key(CounterModel(), ops)
    assert result.ok
    ops.append(o("x", "get", 101, 102, 9))
    result = check_key(CounterModel(), ops)
    assert not result.ok and not result.undecided and [op.kind for op in result.stuck] == ["get"]
    # A search past its budget says no, and that it could not decide.
    result = check_key(CounterModel(), ops, max_steps=5)
    assert not result.ok and result.undecided


def test_from_a_recorded_history(tmp_path: Path) -> None:
    history = History(tmp_path / "h")
    with history.recorder("p1") as rec:
        with rec.call("acquire", "L", session="1@s", shared=False) as c:
            c.ok(output=True)
        with pytest.raises(RuntimeError), rec.call("release", "L", session="1@s", shared=False):
            raise RuntimeError("killed")
    ops = from_history(history.load())
    assert [(x.kind, x.output, x.ret is None) for x in ops] == [("acquire", True, False), ("release", UNKNOWN, True)]
    assert {x.session for x in ops} == {"1@s"} and "session" not in ops[0].args
    assert OK and UNKNOWN_RESULT  # the results from_history reads
    assert check(LockModel(), ops).ok


def test_failure_writes_history_and_picture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_ARTIFACTS", str(tmp_path))
    ops = [o("a", "acquire", 0, 1, True), o("b", "acquire", 2, 3, True)]
    with pytest.raises(AssertionError) as failed:
        assert_linearizable(LockModel(), ops, "planted")
    assert str(tmp_path / "planted" / "history.html") in str(failed.value)
    saved = json.loads((tmp_path / "planted" / "history.json").read_text())
    assert saved["linearizable"] is False and saved["failing_keys"] == ["k"] and len(saved["operations"]) == 2
    page = (tmp_path / "planted" / "history.html").read_text()
    assert "NOT linearizable" in page and "class='op stuck'" in page and page.count("class=row") == 2
    assert write_artifacts(check(LockModel(), ops[:1]), ops[:1], "fine").is_dir()

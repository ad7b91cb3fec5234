"""The wake-up handshake under writers that hold their transaction open, with a broker that never polls; and the
plans of the broker loop's statements, which must never be disabled or JIT-compiled.

The handshake (sql/500_outbox.sql, "Wake-ups"): a writer that finds the broker awake sends no NOTIFY, so
broker_sleep() must see that writer's row ('pending'); a writer that finds it going to sleep or asleep must NOTIFY.
A broken handshake strands a change: committed, and never fetched until something else wakes the broker. The test
below runs the SQL loop of sql/README.md ("The loop, exactly") with no poll at all, so that nothing but the
handshake can wake it, and plants two breaks to show that it sees them.
"""

from __future__ import annotations

import random
import re
import threading
import time

import psycopg
import pytest
from fanout_util import OBJECTS, claim, listen, register, seed_objects, sleep, wake
from psycopg.types.json import Jsonb

# A change not in the broker's hands this long after its commit is stranded: the broker waits for a notification
# (it never polls), so a change the handshake missed waits for ever, and one it did not miss arrives in
# milliseconds.  The bound only ends the wait for "for ever"; no latency is asserted.
STRANDED_AFTER = 3.0


class NeverPollingBroker:
    """The SQL loop of sql/README.md on one session, with no poll: LISTEN; broker_wake; outbox_fetch (acknowledging
    the previous batch) until empty; broker_sleep; 'pending': fetch again; otherwise wait for a notification (an
    hour: never in a test) and broker_wake.  Records when each key was fetched."""

    def __init__(self, connect) -> None:
        self.conn = connect("broker")
        claim(self.conn)
        register(self.conn, "c")
        self.listener = connect("listener")
        listen(self.listener)
        self.fetched: dict[int, float] = {}
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.states: dict[str, int] = {}
        self._notified = threading.Event()
        self._threads = [threading.Thread(target=self._listen, daemon=True), threading.Thread(target=self._loop)]

    def start(self) -> NeverPollingBroker:
        for t in self._threads:
            t.start()
        return self

    def _listen(self) -> None:
        try:
            for _ in self.listener.notifies():
                self._notified.set()
        except psycopg.Error:
            pass  # the connection closed at the end of the test

    def _loop(self) -> None:
        try:
            wake(self.conn)
            ack: list[int] | None = None
            while not self.stop.is_set():
                rows = self.conn.execute("SELECT id, key FROM pgbroker.outbox_fetch(ack => %s)", (ack,)).fetchall()
                ack = None
                if rows:
                    now = time.monotonic()
                    for _, key in rows:
                        self.fetched.setdefault(key, now)
                    ack = [r[0] for r in rows]
                    continue
                self._notified.clear()  # a notification from here on counts
                state = sleep(self.conn)
                self.states[state] = self.states.get(state, 0) + 1
                if state == "pending":
                    continue
                while not self._notified.wait(0.05):  # for ever: only the end of the test stops the wait
                    if self.stop.is_set():
                        return
                wake(self.conn)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def rescue(self) -> None:
        """Wake the broker by hand (what a poll would do), so that a test goes on after a stranded change."""
        self._notified.set()

    def close(self) -> None:
        self.stop.set()
        self._threads[1].join(10)
        self.listener.close()


def stranded_changes(connect, rounds: int, *, stop_at_first: bool = False) -> tuple[int, NeverPollingBroker]:
    """ROUNDS rounds of two writers, each updating a fresh subscribed row of initech.objects and holding its
    transaction 0-3 ms before COMMIT, started 0-2 ms after the broker handed over the previous round's changes
    (so that it is fetching, going to sleep or asleep when they come).  Returns how many changes were stranded."""
    admin = connect("admin")
    keys = list(range(1, 2 * rounds + 1))
    seed_objects(admin, keys)
    broker = NeverPollingBroker(connect)
    broker.conn.execute(
        "SELECT pgbroker.subscribe_many(array_fill('c'::text, ARRAY[%s]), %s::regclass, %s::jsonb[])",
        (len(keys), OBJECTS, [Jsonb(k) for k in keys]),
    )
    broker.start()
    writers = [connect(f"writer {i}", autocommit=False) for i in range(2)]
    stranded = 0
    try:
        for r in range(rounds):
            pair = keys[2 * r : 2 * r + 2]

            def write(conn: psycopg.Connection, key: int) -> None:
                time.sleep(random.uniform(0, 0.002))
                conn.execute("UPDATE initech.objects SET name = 'changed' WHERE id = %s", (key,))
                time.sleep(random.uniform(0, 0.003))
                conn.commit()

            threads = [threading.Thread(target=write, args=(w, k)) for w, k in zip(writers, pair, strict=True)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            deadline = time.monotonic() + STRANDED_AFTER
            while not all(k in broker.fetched for k in pair) and time.monotonic() < deadline and not broker.error:
                time.sleep(0.001)
            assert broker.error is None, broker.error
            missing = [k for k in pair if k not in broker.fetched]
            if missing:
                stranded += len(missing)
                if stop_at_first:
                    break
                broker.rescue()
                deadline = time.monotonic() + STRANDED_AFTER
                while not all(k in broker.fetched for k in pair) and time.monotonic() < deadline:
                    time.sleep(0.001)
    finally:
        broker.close()
    assert broker.error is None, broker.error
    return stranded, broker


def test_no_change_is_stranded_by_a_broker_that_never_polls(connect, watch_mode):
    stranded, broker = stranded_changes(connect, 150)
    assert stranded == 0
    # The rounds did reach the broker asleep and going to sleep, not only awake.
    assert broker.states.get("asleep", 0) > 0


def _replace_in_functions(conn: psycopg.Connection, names_like: str, pattern: str, replacement: str) -> int:
    """Redefine the pgbroker functions whose name is LIKE NAMES_LIKE with PATTERN (a regex) replaced in their
    definition; returns how many changed."""
    changed = 0
    for (definition,) in conn.execute(
        "SELECT pg_get_functiondef(p.oid) FROM pg_proc p"
        " WHERE p.pronamespace = 'pgbroker'::regnamespace AND p.proname LIKE %s AND p.prokind = 'f'",
        (names_like,),
    ).fetchall():
        new, n = re.subn(pattern, replacement, definition, flags=re.S)
        if n and "{{" not in definition:  # the templates are text, not the code that runs
            conn.execute(new)
            changed += 1
    return changed


# Each break removes one half of the handshake.
BREAKS = {
    # broker_sleep() declares the broker asleep without looking at the outbox once more: a writer that saw it
    # awake and committed while it waited for the drain lock is stranded.
    "no re-check in broker_sleep": (
        "broker_sleep",
        r"IF EXISTS \(SELECT FROM pgbroker\.outbox o WHERE",
        "IF false AND EXISTS (SELECT FROM pgbroker.outbox o WHERE",
    ),
    # The triggers do not NOTIFY a broker they find asleep (the awake lock free).
    "no NOTIFY in the trigger's asleep branch": (
        "\\_watch\\_%",
        r"(WHEN pg_try_advisory_lock_shared\(pgbroker\._lock_class_awake\(\).*?"
        r"AND pgbroker\._epoch_alive\([^()]*\)\s*)AND num_nulls\(pg_notify\([^()]*\)\) = 0",
        r"\1",
    ),
}


@pytest.mark.parametrize("broken", sorted(BREAKS))
def test_the_stranding_test_sees_a_broken_handshake(connect, watch_mode, broken):
    names, pattern, replacement = BREAKS[broken]
    assert _replace_in_functions(connect("admin"), names, pattern, replacement) > 0
    stranded, _ = stranded_changes(connect, 300, stop_at_first=True)
    assert stranded > 0


# ---------------------------------------------------------------------------
# The plans of the broker loop.


def _plans_with_a_disabled_node_or_compiled(notices: list[str]) -> list[str]:
    """The plans among auto_explain's notices that hold a disabled node (PostgreSQL 15 to 17 cost it at
    disable_cost, 1e10; 18 prints "Disabled: true") or were JIT-compiled."""
    return [n for n in notices if "cost=10000000000" in n or "Disabled: true" in n or "JIT:" in n]


def test_no_plan_of_the_broker_loop_is_disabled_or_jit_compiled(connect, watch_mode):
    """outbox_fetch, outbox_ack and broker_sleep run with sequential and bitmap scans off (sql/500_outbox.sql): a
    statement they run that has no index path is then disabled, and on PostgreSQL 15 to 17 costed past
    jit_above_cost, so JIT-compiled at every plan: the sequence read of the fetch's floor was, which stalled
    the fetch 17-100 ms every 100 ms while writers, seeing the broker awake, sent no NOTIFY.  Every statement
    of the loop, and of the writers' triggers, is explained here as it runs (auto_explain)."""
    admin = connect("admin")
    seed_objects(admin, range(1, 11))
    broker = connect("broker")
    writer = connect("writer")
    rr_writer = connect("repeatable read writer")
    rr_writer.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    notices: list[str] = []
    for conn in (broker, writer, rr_writer):
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    claim(broker)
    register(broker, "c")
    broker.execute("SELECT pgbroker.subscribe('c', %s::regclass, '1'::jsonb)", (OBJECTS,))
    register(broker, "leaves")
    for conn in (broker, writer, rr_writer):
        conn.execute("LOAD 'auto_explain'")
        conn.execute(
            "SELECT set_config('auto_explain.log_min_duration', '0', false),"
            " set_config('auto_explain.log_nested_statements', 'on', false),"
            " set_config('auto_explain.log_level', 'notice', false)"
        )
    listen(broker)
    wake(broker)
    for turn in range(3):
        broker.execute("SELECT pgbroker.subscribe('leaves', %s::regclass, '1'::jsonb)", (OBJECTS,))
        writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"turn {turn}",))
        with rr_writer.transaction():  # its row names no clients: resolved by the fetch
            rr_writer.execute("UPDATE initech.objects SET name = %s WHERE id = 1", (f"rr turn {turn}",))
        # A client that leaves with a change pending for it: the fetch leaves it out (outbox_departed).
        broker.execute("SELECT pgbroker.client_unregister('leaves')")
        time.sleep(0.12)  # the fetch's floor takes a new (sequence value, xid) at most every 100 ms
        ids = [r[0] for r in broker.execute("SELECT id FROM pgbroker.outbox_fetch()").fetchall()]
        assert ids
        broker.execute("SELECT * FROM pgbroker.outbox_fetch(ack => %s)", (ids,)).fetchall()
        broker.execute("SELECT pgbroker.outbox_ack('default', %s)", (ids,))
        assert sleep(broker) == "asleep"
        wake(broker)
        register(broker, "leaves")
    assert any("outbox_departed" in n for n in notices)  # the fetch's path for departed clients ran
    # The fetches read the outbox sequence for their floor, and moved it up.
    floor = broker.execute("SELECT current_setting('pgbroker.outbox_floor')").fetchone()[0]
    assert int(floor.split(":")[1]) > 0
    explained = [n for n in notices if "plan:" in n]
    assert explained
    assert _plans_with_a_disabled_node_or_compiled(explained) == []

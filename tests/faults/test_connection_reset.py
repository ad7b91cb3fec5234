"""Fault: connections reset (TCP RST) in the middle of calls, over and over.

Two clients loop claim -> heartbeat -> fenced writes -> (sometimes) release,
each through a TCP proxy that, every few tens of milliseconds, resets the
next connection to forward a request just after forwarding it: the request
may or may not have taken effect.  Such operations end ``unknown`` in the
history; afterwards each is resolved from the server's ground truth, never
guessed: a claim or release by what ``pgbroker.lease_history`` recorded for
that connection (every connection has an application_name of its own), a
fenced write by whether its row exists.  The resolved history must pass the
checkers (unique, increasing tokens; no write accepted under an old token;
the server's history matching what the clients were told or resolved), and
every claim event on the server must be explained by exactly one client
operation.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import Counter

import psycopg
from fault_util import check_writes_present, create_fenced_table, fenced_rows, fenced_write, server_history
from history import FAILED, OK, UNKNOWN, History, Op, Recorder, check_fencing, check_lease_history, check_tokens
from tcp_proxy import TcpProxy

NAME = "reset"
RUN_SECONDS = 6.0


def _client(url: str, recorder: Recorder, stop: threading.Event, sessions: dict[str, str]) -> None:
    """Loop until ``stop``; ``sessions``: application_name -> process, for every connection opened."""
    me = recorder.process
    rng = random.Random(me)
    conn: psycopg.Connection | None = None
    epoch: int | None = None
    seq = 0
    opened = 0
    while not stop.is_set():
        try:
            if conn is None:
                opened += 1
                app = f"{me}-{opened}"
                sessions[app] = me
                conn = psycopg.connect(url, autocommit=True, application_name=app, connect_timeout=5)
            if epoch is None:
                with recorder.call("claim", NAME, application=conn.info.parameter_status("application_name")) as call:
                    try:
                        row = conn.execute(
                            "SELECT pgbroker.broker_claim(%s, wait => '50 ms', owner => %s)", (NAME, me)
                        ).fetchone()
                    except psycopg.errors.LockNotAvailable:
                        call.fail(sqlstate="55P03")
                        continue
                    epoch = row[0]
                    call.ok(token=epoch)
            with recorder.call("heartbeat", NAME) as call:
                conn.execute("SELECT pgbroker.broker_heartbeat(%s)", (NAME,))
                call.ok()
            for _ in range(2):
                seq += 1
                if not fenced_write(conn, recorder, NAME, epoch, seq):
                    raise AssertionError(f"{me}: a write fenced with its own live epoch {epoch} was refused")
            if rng.random() < 0.3:
                with recorder.call(
                    "release", NAME, token=epoch, application=conn.info.parameter_status("application_name")
                ) as call:
                    released = conn.execute("SELECT pgbroker.broker_release(%s, %s)", (NAME, me)).fetchone()[0]
                    call.ok(released=released)
                epoch = None
                time.sleep(rng.uniform(0, 0.01))
        except psycopg.OperationalError:
            # The connection is gone, and with it the session and the lease it held.
            if conn is not None:
                conn.close()
            conn, epoch = None, None
    if conn is not None:
        conn.close()


def _resolve(ops: list[Op], rows: list[dict], fenced: dict[tuple[str, int], int]) -> tuple[list[Op], Counter]:
    """Replace each unknown claim, release and write by what the server shows happened.

    One that took effect gets no completion time (``complete`` None: it may have taken effect
    any time after its invocation): the client saw the reset at once, but its backend went on
    (a claim waiting for the lock got it, and committed, only when the holder released it, after
    the client had seen the error and while the holder was still writing), until it noticed the
    dead socket.  Taking the error's time as the completion makes the checkers report false
    violations.
    """
    claims_by_app = {r["application"]: r for r in rows if r["event"] != "release"}
    releases = {(r["application"], r["epoch"]) for r in rows if r["event"] == "release"}
    told = {o.values["token"] for o in ops if o.op == "claim" and o.result == OK}
    tally: Counter = Counter()
    resolved = []
    for o in ops:
        if o.result != UNKNOWN:
            resolved.append(o)
            continue
        if o.op == "claim":
            row = claims_by_app.get(o.args["application"])
            if row is not None and row["epoch"] not in told:
                o = dataclasses.replace(o, result=OK, complete=None, values={"token": row["epoch"], "resolved": True})
                tally["claim took effect"] += 1
            else:
                o = dataclasses.replace(o, result=FAILED, values={"resolved": True})
                tally["claim did not"] += 1
        elif o.op == "release":
            done = (o.args["application"], o.args["token"]) in releases
            o = dataclasses.replace(o, result=OK, complete=None, values={"released": done, "resolved": True})
            tally["release took effect" if done else "release did not"] += 1
        elif o.op == "write":
            done = fenced.get((o.process, o.args["seq"])) == o.args["token"]
            o = dataclasses.replace(o, result=OK if done else FAILED, complete=None, values={"resolved": True})
            tally["write took effect" if done else "write did not"] += 1
        else:
            tally["heartbeat (no effect to resolve)"] += 1
        resolved.append(o)
    return resolved, tally


def test_connection_resets_mid_call_are_resolved_from_the_lease(pg_server, db_name, connect, tmp_path):
    obs = connect("observer")
    create_fenced_table(obs)
    history = History(tmp_path / "history")
    sessions: dict[str, str] = {}
    stop = threading.Event()
    with TcpProxy(pg_server.host, pg_server.port) as proxy:
        recorders = [history.recorder(p) for p in ("A", "B")]
        clients = [
            threading.Thread(target=_client, args=(proxy.url(db_name), r, stop, sessions), daemon=True)
            for r in recorders
        ]
        for t in clients:
            t.start()
        rng = random.Random(11)
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.01, 0.05))
            proxy.arm_reset()
        stop.set()
        for t in clients:
            t.join(20)
            assert not t.is_alive(), "a client hung"
        resets = proxy.resets
    for r in recorders:
        r.close()

    # Every session of the run has ended; the server has recorded all it will.
    rows = server_history(obs, NAME)
    fenced = fenced_rows(obs)
    ops = history.load()
    unknown = Counter(o.op for o in ops if o.result == UNKNOWN)
    resolved, tally = _resolve(ops, rows, fenced)
    acked = sum(1 for o in ops if o.op == "write" and o.result == OK)
    print(
        f"\nFIGURE connection reset: {resets} resets in {RUN_SECONDS:.0f} s, {len(ops)} ops, unknown outcomes "
        f"{sum(unknown.values())} ({dict(unknown)}), resolved: {dict(tally)}; {len(rows)} lease events, "
        f"{acked} acknowledged writes, {len(fenced)} rows"
    )
    assert resets >= 20 and sum(unknown.values()) >= 10  # the fault did hit calls in flight
    assert not any(o.result == UNKNOWN for o in resolved if o.op != "heartbeat")
    violations = check_tokens(resolved) + check_fencing(resolved) + check_lease_history(rows, resolved, name=NAME)
    violations += check_writes_present(resolved, fenced)
    assert not violations, "\n".join(map(str, violations))
    # The resolution is exact: every claim on the server is one client claim, told or resolved, and
    # every row on the server is a write acknowledged or resolved as done.
    claimed = Counter(o.values["token"] for o in resolved if o.op == "claim" and o.result == OK)
    server_claims = Counter(r["epoch"] for r in rows if r["event"] != "release")
    assert claimed == server_claims
    assert all(r["application"] in sessions for r in rows)
    done_writes = {(o.process, o.args["seq"]) for o in resolved if o.op == "write" and o.result == OK}
    assert done_writes == set(fenced)

"""The broker lease from Python: :class:`Broker` (threads) and :class:`AsyncBroker` (asyncio).

A broker object owns one dedicated, autocommit psycopg connection.  It claims
the lease with ``pgbroker.broker_claim()``, keeps it alive with
``pgbroker.broker_heartbeat()`` and releases it with
``pgbroker.broker_release()``; every rule lives in that SQL.  Python only
opens the connection, calls the functions, watches the connection and turns
SQLSTATEs into exceptions (:func:`pgbroker.errors.translate`).

    with Broker(url, "orders", wait=None, dead_man=2.0, heartbeat_interval=0.25) as broker:
        while True:
            broker.check()                  # raises LeaseLost: stop acting
            with other_conn.transaction():
                broker.assert_epoch(other_conn)   # fences the write below
                other_conn.execute("UPDATE ...")

How loss is noticed
-------------------
A watcher (a thread for :class:`Broker`; a task that waits in a worker thread
for :class:`AsyncBroker`) sleeps on the connection's socket between
heartbeats.  Anything the server sends unasked -- above all the FATAL message
and end-of-file of a terminated backend or a shut-down server -- wakes it at
once; it then runs a heartbeat, which fails.  A failed heartbeat (connection
gone, SQLSTATE classes 08 / 57P, or PB001 "this session does not hold the
lease") marks the broker lost: ``lost`` becomes true, ``on_lost(exc)`` is
called once (from the thread or task that noticed it), and :meth:`check`
raises :class:`~pgbroker.errors.LeaseLost` from then on.  A broker claims
once: after a loss, create a new one.

The timing bound
----------------
Let *t0* be the moment (client clock) the last successful heartbeat was
*sent*.  :meth:`check` raises once ``guard`` seconds have passed since *t0*,
even if the watcher is wedged, so a holder that calls ``check()`` before each
action stops acting in bounded time.  The lease can change hands in two ways:

1. **The server stops hearing from the holder** (process paused by SIGSTOP, a
   VM freeze or a long GC; network partition; half-dead peer).  The server
   then frees the lock no earlier than *T* seconds after *t0*, where *T* is
   the smallest of: ``keepalive.idle`` (server-side TCP keepalive, set on the
   session), ``keepalive.user_timeout`` (server-side TCP_USER_TIMEOUT),
   ``dead_man`` (``idle_session_timeout`` on the broker session, if given),
   and the ``stale_after`` another claimant passes to ``broker_claim()``.
   The constructor enforces ``heartbeat_interval < guard < T`` for the first
   three (``stale_after`` is the claimant's choice: use one larger than the
   holders' ``guard``).  So in this case :meth:`check` raises **before** any
   other session can have claimed the lease: the holder stops first.  (It
   returns the seconds left; an action that may outlast them needs the
   fencing of case 2.)
   The holder's own side notices a dead peer too: a heartbeat into a dead
   connection fails after ``keepalive.user_timeout`` (client-side
   TCP_USER_TIMEOUT), and an idle one after keepalive probes fail
   (``idle + interval * count``), which fires ``on_lost``.

2. **The server ends the holder's session** while the holder is healthy
   (``takeover => true``, ``pg_terminate_backend``, server shutdown or
   crash).  The lock is freed at once and a waiting claimant may commit its
   claim within milliseconds.  The holder learns it as fast as the server's
   message reaches its socket (the watcher wakes at once: measured about
   3 ms after ``pg_terminate_backend`` on loopback; at worst ``guard`` if
   the watcher is wedged), but there is no "before": for that short window
   both may believe they hold the lease.
   This is why the epoch exists.  Statements on the broker's own connection
   fail at once (its backend is gone), and writes made on *other*
   connections must be fenced: call :meth:`Broker.assert_epoch` (``SELECT
   pgbroker.broker_assert(name, epoch)``) inside the writing transaction.  It
   fails with :class:`~pgbroker.errors.StaleEpoch` once a newer epoch exists
   or the holder's session is gone, and it blocks a concurrent claim until
   the fenced transaction ends.

While no heartbeat has been confirmed for ``guard`` seconds and the loss is
not known, :meth:`check` raises :class:`~pgbroker.errors.LeaseInDoubt`, the
subclass of ``LeaseLost`` whose ``final`` is False (not sticky); every other
``LeaseLost`` is final.

Thread safety: one lock serialises every use of the lease connection, so the
heartbeat thread and any number of caller threads may share a :class:`Broker`.
The delivery methods go through :meth:`Broker._execute` /
:meth:`AsyncBroker._execute`, which do the locking, the loss detection and the
error translation.  The client-registry and subscription methods run on
registry connections of their own, fenced by the epoch (``registry_connections``),
so that a subscribe waiting for a writer never holds up the heartbeats;
:meth:`Broker.notifications` listens on a connection of its own too, and reads
rows (``rows=True``, :meth:`Broker.read_rows`) on another.
:func:`run_broker` / :func:`async_run_broker` claim, serve and claim again.

Where the code is
-----------------
One implementation, two flavours: :mod:`pgbroker._core` holds everything
without I/O (the statements, settings and their checks, the lease's state,
:meth:`check`, :class:`Keepalive`, :class:`Notification`);
:mod:`pgbroker._broker_async` is :class:`AsyncBroker`, and
:mod:`pgbroker._broker_sync` (:class:`Broker`) is generated from it by
``python3 -m pgbroker._gen_sync``.  This module gathers the public names.
"""

from __future__ import annotations

from pgbroker._broker_async import AsyncBroker, async_run_broker
from pgbroker._broker_sync import Broker, run_broker
from pgbroker._core import ASSERT_SQL as ASSERT_SQL  # re-exported: the demo fences a write with it
from pgbroker._core import Keepalive, Notification, Registration, lease_history, list_brokers

__all__ = [
    "AsyncBroker",
    "Broker",
    "Keepalive",
    "Notification",
    "Registration",
    "async_run_broker",
    "run_broker",
    "list_brokers",
    "lease_history",
]

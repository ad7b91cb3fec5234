"""The coordination primitives from Python: named locks, semaphores, the key-value store, counters, rate limits.

Threads: :class:`Lock`, :class:`Semaphore`, :class:`KV`, :class:`Counter`,
:class:`RateLimiter`, :func:`lock`.  asyncio: :class:`AsyncLock`,
:class:`AsyncSemaphore`, :class:`AsyncKV`, :class:`AsyncCounter`,
:class:`AsyncRateLimiter`, :func:`async_lock`.  Each wraps the
SQL functions of the same name in the schema ``pgbroker`` on a psycopg
connection of the caller's; errors are those of :mod:`pgbroker.errors`.

    with Lock(conn, "jobs", timeout=5):
        ...
    async with AsyncSemaphore(aconn, "uploads", limit=3) as sem:
        print(sem.permit)

Session-scoped locks and semaphores need a connection that keeps its server
session: through a pooler they raise
:class:`~pgbroker.errors.PoolerNotSupported` (pass ``session_pooler=True``
for a pooler in session mode); transaction-scoped locks (``xact=True``),
counters, the key-value store and rate limiters work through any pooler.

One implementation: :mod:`pgbroker._primitives_async` is the source, and
:mod:`pgbroker._primitives_sync` is generated from it by
``python3 -m pgbroker._gen_sync``; :mod:`pgbroker._primitives_core` holds the
statements and types they share.
"""

from __future__ import annotations

from pgbroker._primitives_async import AsyncCounter, AsyncKV, AsyncLock, AsyncRateLimiter, AsyncSemaphore, async_lock
from pgbroker._primitives_core import SEMAPHORE_FALLBACK, KVChange, KVEntry, RateLimitResult
from pgbroker._primitives_sync import KV, Counter, Lock, RateLimiter, Semaphore, lock

__all__ = [
    "AsyncCounter",
    "AsyncKV",
    "AsyncLock",
    "AsyncRateLimiter",
    "AsyncSemaphore",
    "Counter",
    "KV",
    "KVChange",
    "KVEntry",
    "Lock",
    "RateLimiter",
    "RateLimitResult",
    "SEMAPHORE_FALLBACK",
    "Semaphore",
    "async_lock",
    "lock",
]

"""Lease and registry events from Python: who holds a lease, live; a broker's registry, live.

:func:`observe` / :func:`async_observe` yield who holds a lease at once and at every claim, release,
takeover and expiry (etcd's election ``Observe``, client-go's ``OnNewLeader``).  :func:`registry_feed` /
:func:`async_registry_feed` keep a live copy of a broker's clients and subscriptions for a frontend.  Both
LISTEN before they read, so they miss nothing, and need only ``pgbroker_reader``.

    for state in pgbroker.observe(conn, "orders"):
        print(state.epoch, state.holder_pid, state.alive, state.event)

    for registry, event in pgbroker.registry_feed(conn, "orders"):
        render(registry.clients)                  # applied already; event is None for a fresh copy

One implementation: :mod:`pgbroker._events_async` is the source, and :mod:`pgbroker._events_sync` is
generated from it by ``python3 -m pgbroker._gen_sync``.
"""

from __future__ import annotations

from pgbroker._events_async import LeaseState, Registry, RegistryEvent, async_observe, async_registry_feed
from pgbroker._events_sync import observe, registry_feed

__all__ = [
    "LeaseState",
    "Registry",
    "RegistryEvent",
    "async_observe",
    "async_registry_feed",
    "observe",
    "registry_feed",
]

"""pgbroker: PostgreSQL as the coordination layer of a backend.

A singleton broker lease with fencing epochs, change fan-out to subscribed
clients, named locks, semaphores, a key-value store, counters and rate
limits.  The logic lives in PL/pgSQL in the schema ``pgbroker``; this package
applies the migrations and wraps the SQL API for Python callers (see
pgbroker/README.md).
"""

from pgbroker.broker import AsyncBroker, Broker, Keepalive, Notification, Registration, async_run_broker, run_broker
from pgbroker.errors import (
    DatabaseError,
    InvalidArgument,
    LeaseHeld,
    LeaseInDoubt,
    LeaseLost,
    NotAcquired,
    NotHolder,
    NotWatchable,
    NotWatched,
    OwnerMismatch,
    PermissionDenied,
    PgBrokerError,
    PoolerNotSupported,
    SchemaMismatch,
    SchemaMissing,
    StaleEpoch,
    TableBusy,
    UnknownClient,
)
from pgbroker.events import (
    LeaseState,
    Registry,
    RegistryEvent,
    async_observe,
    async_registry_feed,
    observe,
    registry_feed,
)
from pgbroker.install import migrate
from pgbroker.primitives import (
    KV,
    AsyncCounter,
    AsyncKV,
    AsyncLock,
    AsyncRateLimiter,
    AsyncSemaphore,
    Counter,
    KVChange,
    KVEntry,
    Lock,
    RateLimiter,
    RateLimitResult,
    Semaphore,
    async_lock,
    lock,
)

__all__ = [
    "AsyncBroker",
    "Broker",
    "Keepalive",
    "Notification",
    "Registration",
    "run_broker",
    "async_run_broker",
    "DatabaseError",
    "LeaseInDoubt",
    "InvalidArgument",
    "LeaseHeld",
    "OwnerMismatch",
    "LeaseLost",
    "NotAcquired",
    "NotHolder",
    "NotWatchable",
    "NotWatched",
    "PermissionDenied",
    "PgBrokerError",
    "PoolerNotSupported",
    "SchemaMismatch",
    "SchemaMissing",
    "StaleEpoch",
    "TableBusy",
    "UnknownClient",
    "migrate",
    "LeaseState",
    "Registry",
    "RegistryEvent",
    "async_observe",
    "async_registry_feed",
    "observe",
    "registry_feed",
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
    "Semaphore",
    "async_lock",
    "lock",
]
__version__ = "0.1.0"

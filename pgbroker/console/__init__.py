"""``pgbroker console``: the broker, its clients and every name, live in a browser.

A small Starlette application served by uvicorn (the ``console`` extra:
``pip install 'pgbroker[console]'``).  It reads the views of
``sql/700_views.sql`` and ``sql/750_console.sql`` through a small pool of
read-only connections (``default_transaction_read_only``), one page at a time
(keyset pagination, at most :data:`MAX_PAGE` rows a request), and holds one
more connection that LISTENs on ``lease_channel()`` and, for every lease name,
on ``registry_channel(name)`` after ``registry_watch_begin(name)``.  What that
connection hears is pushed to every open page through Server-Sent Events
(``/events``); the page redraws what changed.  Locks, semaphores, the
key-value store, counters and rate limits have no channel a reader may
LISTEN on: the page re-reads the one it shows every second.

Safe to leave running: it needs a role that is a member of
``pgbroker_reader`` and nothing more, refuses a superuser unless told
``allow_superuser``, binds to 127.0.0.1 unless told otherwise, answers only
requests addressed to the host it was bound to (DNS rebinding), sends a
Content-Security-Policy that forbids inline scripts, and the page renders
every name and value as text.  With ``admin`` (a role with
``pgbroker_admin``) two write actions exist, each confirmed by typing the
name it acts on and carrying the page's CSRF token: handing a lease over
(``broker_claim(takeover => true)`` then ``broker_release``: its holder is
terminated, recorded in ``lease_history``, and a waiting standby claims) and
revoking a name grant (``name_revoke``); both are logged on the
``pgbroker.console`` logger.  When the database restarts or fails over, the
page says so and everything reconnects with a backoff.
"""

from __future__ import annotations

from pgbroker.console.app import (
    MAX_PAGE,
    ConsoleRefused,
    RoleCheck,
    check_role,
    create_app,
    serve,
)

__all__ = ["MAX_PAGE", "ConsoleRefused", "RoleCheck", "check_role", "create_app", "serve"]

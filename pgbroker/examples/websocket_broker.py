"""A websocket broker on pgbroker: clients watch rows of a table and are pushed every change, from one instance.

    pip install 'pgbroker[examples]'
    python -m pgbroker.examples.websocket_broker --url postgresql://broker@db/app --port 8765

Run it twice: the second instance waits (printing who holds the lease) and takes over within milliseconds of the
first one's end, ``kill -9`` included; the clients reconnect to it and get a fresh snapshot.  A client connects,
sends ``{"client": "c7", "watch": [1, 2, 3]}`` (keys of ``--table``; or ``"filter": {"kind": "gear"}``, its rows by
column value, or both) and receives ``{"type": "snapshot", "epoch":
N, "rows": {"1": {...} or null, ...}}``, then ``{"type": "change", "op": "U", "key": 1, "row": {...} or null}`` for
every committed change of a watched row, in commit order per row, each row as it is when the change is delivered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

import pgbroker


class WebsocketBroker:
    def __init__(self, table: str, host: str, port: int):
        self.table, self.host, self.port = table, host, port
        self.queues: dict[str, asyncio.Queue[str]] = {}  # client id -> its messages not yet sent
        self.broker: pgbroker.AsyncBroker | None = None

    async def lead(self, broker: pgbroker.AsyncBroker) -> None:
        """One term as the holder of the lease: serve websockets and push changes until the lease is lost."""
        self.broker = broker
        async with serve(self.handler, self.host, self.port):
            print(f"serving epoch {broker.epoch} on ws://{self.host}:{self.port}", flush=True)
            async for batch in broker.notifications(rows=True):  # raises LeaseLost when the term ends
                for n in batch:
                    message = json.dumps({"type": "change", "op": n.op, "key": n.key, "row": n.row})
                    for client in n.clients:  # (a client in n.left: the row left its filter)
                        queue = self.queues.get(client)
                        if queue is not None:
                            queue.put_nowait(message)

    async def handler(self, ws: ServerConnection) -> None:
        broker = self.broker
        assert broker is not None
        hello = json.loads(await ws.recv())
        client, keys, flt = str(hello["client"]), list(hello.get("watch", [])), hello.get("filter")
        registration = await broker.attach(client, {"peer": str(ws.remote_address)})
        queue: asyncio.Queue[str] = asyncio.Queue()
        sender = None
        try:
            await broker.subscribe_many([(client, key) for key in keys], self.table)
            if flt:  # {"kind": "gear"}: every row of kind gear, those that become so, and those that stop being so
                await broker.subscribe(client, self.table, filter=flt)
            rows = dict(zip(map(str, keys), await broker.read_rows(self.table, keys), strict=True))
            matching = await broker.read_filter(self.table, flt) if flt else []
            # No await from the last read to the queue's registration: every change the loop yields from now on was
            # read after this snapshot, and those it yielded before are older (AsyncBroker.read_rows, read_filter).
            rows.update((str(r["id"]), r) for r in matching)
            snapshot = {"type": "snapshot", "epoch": broker.epoch, "rows": rows}
            queue.put_nowait(json.dumps(snapshot))
            self.queues[client] = queue
            sender = asyncio.ensure_future(self.send(ws, queue))
            await ws.wait_closed()
        finally:
            if sender is not None:
                sender.cancel()
            if self.queues.get(client) is queue:
                del self.queues[client]
            if broker.held:  # a reconnect of the same client made a newer registration: this leaves it alone
                with contextlib.suppress(pgbroker.PgBrokerError):
                    await broker.unregister(client, token=registration.token)

    async def send(self, ws: ServerConnection, queue: asyncio.Queue[str]) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await ws.send(await queue.get())


def waiting(held: pgbroker.LeaseHeld) -> None:
    print(f"standby: lease {held.name} held by pid {held.pid} ({held.info}), epoch {held.epoch}", flush=True)


def lost(exc: pgbroker.LeaseLost) -> None:
    print(f"lease lost ({exc}); claiming again", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pgbroker.examples.websocket_broker", description=__doc__)
    parser.add_argument("--url", default=os.environ.get("DATABASE_URL"), help="default: $DATABASE_URL")
    parser.add_argument("--name", default="websocket-broker", help="the lease name")
    parser.add_argument("--table", default="initech.objects", help="the watched table clients watch rows of")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set DATABASE_URL")
    server = WebsocketBroker(args.table, args.host, args.port)
    options: dict[str, Any] = {"on_waiting": waiting, "on_lost": lost}
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(pgbroker.async_run_broker(args.url, args.name, on_start=server.lead, **options))


if __name__ == "__main__":
    main()

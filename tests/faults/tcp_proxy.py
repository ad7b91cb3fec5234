"""A TCP proxy for fault tests: asyncio, in a thread of its own, on loopback.

``TcpProxy(host, port)`` listens on 127.0.0.1 (``proxy.port``) and forwards
every connection it accepts to ``host:port``.  From the test's thread:

- :meth:`freeze` / :meth:`thaw`: stop and resume forwarding, both
  directions, every connection (new ones too); the sockets stay open, so
  both kernels keep acknowledging (TCP keepalives are answered): only
  application-level timeouts can notice, as with a hung middlebox;
- :meth:`reset`: abort connections with a TCP RST (``SO_LINGER`` 0) to both
  ends, at once;
- :meth:`arm_reset`: reset the next connection that forwards a chunk from
  its client, just after that chunk went to the server (a reset in the
  middle of a call: the request may or may not have taken effect);
- :attr:`links`: the connections, numbered in the order they were accepted.

Used as a context manager (``with TcpProxy(...) as proxy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

_CHUNK = 65536


@dataclass
class Link:
    """One proxied connection: the client side and the server side."""

    number: int
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    closed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _abort_with_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class TcpProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.links: list[Link] = []
        self.resets = 0  # connections aborted with RST
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._flowing: asyncio.Event | None = None
        self._armed = 0
        self._server: asyncio.Server | None = None

    # -- life cycle (test thread) ----------------------------------------------

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def url(self, dbname: str, user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    # -- faults (test thread) ----------------------------------------------------

    def freeze(self) -> None:
        """Stop forwarding, both directions, every connection; the sockets stay open."""
        self._call(self._set_flowing(False))

    def thaw(self) -> None:
        self._call(self._set_flowing(True))

    def reset(self, numbers: list[int] | None = None) -> int:
        """RST the open connections (those numbered ``numbers``, or all); returns how many."""
        return self._call(self._reset(numbers))

    def arm_reset(self) -> None:
        """Reset the next connection that forwards a chunk from its client, right after forwarding it."""
        self._loop.call_soon_threadsafe(self._arm)

    def open_links(self) -> list[int]:
        return self._call(self._open_links())

    # -- the loop's side ---------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._reset(None)

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _open_links(self) -> list[int]:
        return [link.number for link in self.links if not link.closed]

    def _arm(self) -> None:
        self._armed += 1

    async def _reset(self, numbers: list[int] | None) -> int:
        count = 0
        for link in self.links:
            if link.closed or (numbers is not None and link.number not in numbers):
                continue
            self._abort(link)
            count += 1
        return count

    def _abort(self, link: Link) -> None:
        if link.closed:
            return
        link.closed = True
        self.resets += 1
        _abort_with_rst(link.client)
        _abort_with_rst(link.server)
        for task in link.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _abort_with_rst(client_writer)
            return
        for writer in (client_writer, server_writer):
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = Link(len(self.links), client_writer, server_writer)
        self.links.append(link)
        link.tasks = [
            asyncio.create_task(self._pump(link, client_reader, server_writer, from_client=True)),
            asyncio.create_task(self._pump(link, server_reader, client_writer, from_client=False)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        if not link.closed:
            link.closed = True
            for writer in (client_writer, server_writer):
                writer.close()

    async def _pump(
        self, link: Link, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, from_client: bool
    ) -> None:
        assert self._flowing is not None
        try:
            while not link.closed:
                await self._flowing.wait()  # frozen: read nothing more, so the sender's buffers fill
                data = await src.read(_CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # frozen: hold what was read
                dst.write(data)
                await dst.drain()
                if from_client and self._armed:
                    self._armed -= 1
                    await asyncio.sleep(random.uniform(0, 0.003))  # the server may or may not be done
                    self._abort(link)
                    return
        except (OSError, asyncio.CancelledError):
            pass
        # One side closed cleanly: pass the close on.
        if not link.closed:
            with contextlib.suppress(OSError, RuntimeError):
                dst.write_eof()

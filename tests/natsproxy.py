"""A small TCP proxy in front of a real nats-server, for tests: it forwards a
client's protocol, drops chosen PUB/HPUB messages (a server that silently loses a
publish while the connection stays up), and can delay both directions (a long
link: RTT = 2 * delay)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class NatsProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.drop: Callable[[bytes, bytes], bool] = lambda line, body: False
        self.dropped: list[bytes] = []
        self.delay = 0.0  # seconds added to each direction (a long link: RTT = 2 * delay)
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._conns: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> NatsProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for a, b in self._conns:
            a.close()
            b.close()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        sreader, swriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._conns.append((cwriter, swriter))
        loop = asyncio.get_running_loop()
        to_server: asyncio.Queue = asyncio.Queue()
        to_client: asyncio.Queue = asyncio.Queue()

        async def pipe(queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    due, data = await queue.get()
                    if data is None:
                        break
                    if (wait := due - loop.time()) > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        pipes = [
            asyncio.ensure_future(pipe(to_server, swriter)),
            asyncio.ensure_future(pipe(to_client, cwriter)),
        ]

        async def up() -> None:
            try:
                while True:
                    line = await creader.readuntil(b"\r\n")
                    op = line.split(b" ", 1)[0].upper()
                    body = b""
                    if op in (b"PUB", b"HPUB"):
                        size = int(line.split()[-1])
                        body = await creader.readexactly(size + 2)
                        if self.drop(line, body):
                            self.dropped.append(body)
                            continue
                    to_server.put_nowait((loop.time() + self.delay, line + body))
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                pass
            finally:
                to_server.put_nowait((0.0, None))

        async def down() -> None:
            try:
                while data := await sreader.read(65536):
                    to_client.put_nowait((loop.time() + self.delay, data))
            except (ConnectionError, OSError):
                pass
            finally:
                to_client.put_nowait((0.0, None))

        await asyncio.gather(up(), down(), *pipes)


class PartitionProxy:
    """A TCP proxy in front of one server for one host. ``blocked``: traffic in
    both directions is read and dropped (a partition: connections stay open,
    nothing arrives), until ``heal``. ``stalled``: nothing is read meanwhile,
    and all of it arrives late once it is cleared (a link that stopped and came
    back before TCP gave up)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.blocked = False
        self.stalled = False
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(1 << 16):
                    while self.stalled:
                        await asyncio.sleep(0.02)
                    if not self.blocked:
                        sink.write(data)
                        await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

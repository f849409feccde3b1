"""The ``coordinator`` command.

Exit status: 0 success; 1 the thing checked is corrupt or failed its check;
2 bad command line; 3 a file could not be accessed; 130 interrupted (Ctrl-C);
141 stdout's reader went away (``main``); the rest in ``EXIT_STATUSES``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import mmap
import os
import re
import shlex
import signal
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar, cast

import msgspec

from .connection import Connection, add_options, given, redact, resolve
from .envelope import Envelope, decode
from .errors import (
    BusRefusedError,
    BusUnavailableError,
    CommitError,
    CoordinatorError,
    CorruptEnvelopeError,
    InvalidScalarError,
    NotAStoreError,
    UsageError,
)
from .fs import FileSystem
from .ids import is_id
from .manifest import manifest_from_builtins

if TYPE_CHECKING:
    from rich.console import Console

    from .presence import Presence

__all__ = ["main"]

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREADABLE = 3
EXIT_NOT_CHECKPOINT = 4
EXIT_ADDRESS = 5
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141
EXIT_TERMINATED = 143

EXIT_STATUSES = f"""exit status:
  {EXIT_OK}    ok
  {EXIT_FAILED}    failed: a corrupt checkpoint, a store that does not verify, a command that
       did not do its work (the line says which code)
  {EXIT_USAGE}    usage: bad arguments
  {EXIT_UNREADABLE}    unreadable: no such file or directory, permission denied, not a regular file
  {EXIT_NOT_CHECKPOINT}    not a checkpoint: a directory that is no store, an empty store, or a file
       given to ls or restore (store.not_a_store)
  {EXIT_ADDRESS}    the dashboard cannot listen there (the address is in use, or not this host's)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
  {EXIT_PIPE_CLOSED}  the reader of the output went away (a closed pipe: `| head`)
  {EXIT_TERMINATED}  terminated (SIGTERM)"""

_SIZE = re.compile(r"(\d+)\s*(B|KiB|MiB|GiB)?", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _size(text: str) -> int:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1GiB or 256MiB)")
    size = int(match[1]) * _UNITS[(match[2] or "b").lower()]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > memory:  # every bench holds its state in memory
        raise argparse.ArgumentTypeError(
            f"{text}: more than this machine's memory ({memory >> 20} MiB)"
        )
    return size


def _path(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("an empty path names nothing")
    return Path(text)


def _file_mode(text: str) -> int:
    """``--mode``: an octal file mode a store may give (``store._modes``)."""
    from .store import check_mode

    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no octal mode (say 640)") from None
    try:
        return check_mode(mode)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _source(text: str) -> Path | str:
    """A store directory, or a NATS URL (the replicated tier) kept as it is."""
    return text if text.startswith(("nats://", "tls://")) else _path(text)


def _store(path: Path) -> Path:
    """``path`` if it is a store directory: ``FileNotFoundError`` if there is nothing
    there, ``NotAStoreError`` for a file (a checkpoint file says which commands read
    one) or a directory without ``manifest.json`` (an empty directory, loose
    checkpoint files, or a store never committed to: ``LOCK`` alone)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path)) from None
    if not path.is_dir():
        if not path.is_file():  # a FIFO, a device: as `verify` and `inspect` say it
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        raise NotAStoreError(str(path), kind="checkpoint" if _is_envelope(path) else "file")
    try:
        os.stat(path / "manifest.json")  # a PermissionError says so: not "not a store"
    except FileNotFoundError:  # (a store never committed to holds nothing to read)
        empty = (path / "LOCK").is_file()
        raise NotAStoreError(str(path), kind="empty" if empty else "directory") from None
    return path


def _is_envelope(path: Path) -> bool:
    """A checkpoint file, by its name or its first bytes (FLYSESS1's magic)."""
    if path.suffix == ".flysess":
        return True
    try:
        with path.open("rb") as file:
            return file.read(8) == b"FLYSESS1"
    except OSError:
        return False


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of hours: {text!r}") from None
    if not 0 < value < 10_000:  # (nan and inf are neither)
        raise argparse.ArgumentTypeError("must be more than 0 and less than 10000")
    return value


@contextlib.contextmanager
def _open_envelope(path: Path) -> Iterator[Envelope]:
    """Decode ``path`` through a read-only mmap; views are dropped before unmapping."""
    os.stat(path)  # missing: "No such file or directory"; no access: "Permission denied"
    if path.is_dir():  # a store, most likely: say which command reads one
        quoted = shlex.quote(str(path))
        if (path / "manifest.json").exists():
            why = f"a store directory, not a checkpoint file: `coordinator ls {quoted}` lists it"
        else:
            why = "a directory, not a checkpoint file (a store directory: `coordinator ls DIR`)"
        raise IsADirectoryError(errno.EISDIR, why, str(path))
    if not path.is_file():  # a FIFO or device would block or mislead
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    # (a generation's shared flock: a live writer never writes over it meanwhile)
    with os.fdopen(FileSystem().open_generation(os.path.realpath(path)), "rb") as file:
        if path.stat().st_size == 0:
            yield decode(b"")  # refused: too short
            return
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            envelope = decode(mapped)
            try:
                yield envelope
            finally:
                envelope.release()


def _describe(envelope: Envelope, path: Path) -> dict[str, Any]:
    return {
        "file": str(path),
        "layout": msgspec.to_builtins(envelope.layout),
        "prefixDigest": envelope.prefix_digest,
        "manifest": envelope.manifest,
    }


def _print_inspect(envelope: Envelope, path: Path, out: TextIO) -> None:
    layout = envelope.layout
    manifest = envelope.manifest
    scope = manifest.get("sourceScope")
    scope = scope if isinstance(scope, dict) else {}
    print(f"file        {path} ({layout.file_bytes} bytes)", file=out)
    print(
        f"envelope    FLYSESS1 version {layout.envelope_version}, "
        f"header {layout.header_bytes} bytes",
        file=out,
    )
    print(f"manifest    offset {layout.manifest_offset}, {layout.manifest_bytes} bytes", file=out)
    print(f"table       offset {layout.table_offset}, {layout.payload_count} entries", file=out)
    print(f"footer      offset {layout.footer_offset}, sha256 {envelope.prefix_digest}", file=out)
    shown = {
        "checkpoint": manifest.get("checkpointId"),
        "session": scope.get("sessionId"),
        "epoch": scope.get("epoch"),
        "step": scope.get("step"),
        "episode": manifest.get("episodeId"),
    }
    # json.dumps escapes control characters: a hostile file cannot drive the terminal.
    print("  ".join(f"{key} {json.dumps(value)}" for key, value in shown.items()), file=out)
    if layout.entries:
        width = max(len(entry.name) for entry in layout.entries)
        print("payloads", file=out)
        print(f"  {'name'.ljust(width)}  {'offset':>12}  {'bytes':>12}  sha256", file=out)
        for entry in layout.entries:
            print(
                f"  {entry.name.ljust(width)}  {entry.offset:>12}  {entry.byte_length:>12}  "
                f"{entry.digest}",
                file=out,
            )
    from .monitor import printable_json  # (bidi overrides, C1 controls: escaped)

    print("manifest (canonical on disk, indented here):", file=out)
    print(printable_json(json.dumps(manifest, indent=2, ensure_ascii=False)), file=out)


def _report_failure(error: CoordinatorError, path: Path | str, err: TextIO) -> int:
    """One line: where, the stable code, the failed check if any, and what happened."""
    if isinstance(error, CorruptEnvelopeError):
        print(f"{path}: CORRUPT [{error.code}] {error}", file=err)  # names its check
    else:
        print(f"{path}: FAILED [{error.code}] {error}", file=err)
    if isinstance(error, NotAStoreError):
        return EXIT_NOT_CHECKPOINT
    return EXIT_USAGE if isinstance(error, UsageError) else EXIT_FAILED


def _inspect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .monitor import printable_json

    with _open_envelope(args.file) as envelope:
        if args.json:
            described = json.dumps(_describe(envelope, args.file), indent=2, ensure_ascii=False)
            print(printable_json(described), file=out)
        else:
            _print_inspect(envelope, args.file, out)
    return EXIT_OK


def _verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """A file: every envelope check, then the typed manifest rules. A store
    directory: every listed generation, plus stray and temporary files."""
    if args.file.is_dir():
        return _verify_store(_store(args.file), out, err)
    with _open_envelope(args.file) as envelope:
        manifest = manifest_from_builtins(envelope.manifest)
        layout = envelope.layout
        print(
            f"{args.file}: ok, FLYSESS1 checkpoint {manifest.checkpoint_id}, "
            f"{layout.payload_count} payloads, {layout.file_bytes} bytes",
            file=out,
        )
    return EXIT_OK


def _verify_store(path: Path, out: TextIO, err: TextIO) -> int:
    from .monitor import printable  # (file names are whoever wrote them: escaped)
    from .store import SPARE_PREFIX, SyncStore

    with SyncStore(path, read_only=True, create=False) as store:
        report = store.verify()
    for checkpoint_id in report.verified:
        print(f"ok       {checkpoint_id}", file=out)
    for failure in report.failures:
        print(f"CORRUPT  {failure.checkpoint_id} [{failure.code}] {failure.check}", file=err)
        print(f"  {failure}", file=err)
    spares = [name for name in report.temporaries if name.startswith(SPARE_PREFIX)]
    for name in report.temporaries:
        if name not in spares:
            print(f"temporary (not a checkpoint): {printable(name)}", file=out)
    if spares:  # (no problem: temporaries of a kind, see docs/store.md "Spares")
        print(
            f"spares: {len(spares)} (rotated-out files a writer keeps to write over; "
            "the next open for writing removes any left)",
            file=out,
        )
    for name in report.unreferenced:
        print(f"unreferenced (not listed, never restored): {printable(name)}", file=out)
    verdict = "ok" if report.ok else "FAILED"
    print(
        f"{path}: {verdict}, {len(report.verified)} of "
        f"{len(report.verified) + len(report.failures)} generations verify",
        file=out if report.ok else err,
    )
    return EXIT_OK if report.ok else EXIT_FAILED


def _ls(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .store import SyncStore, on_timeline

    with SyncStore(_store(args.store), read_only=True, create=False) as store:
        records = store.generations
        sessions = store.sessions
    if args.json:
        document = {
            "store": str(args.store),
            # the high water of the store's only session (null with several: see sessions)
            "highWater": sessions[0].high_water if len(sessions) == 1 else None,
            "generations": msgspec.to_builtins(list(records)),
            "sessions": msgspec.to_builtins(list(sessions)),
        }
        print(json.dumps(document, indent=2), file=out)
        return EXIT_OK
    if not records:
        print(f"{args.store}: no generations", file=out)
        return EXIT_OK
    rows = [("", "checkpoint", "epoch", "boundary", "bytes", "sha256")]
    headers: dict[int, str] = {}
    for session in sessions:
        mine = [r for r in reversed(records) if r.session_id == session.session_id]
        headers[len(rows)] = (
            f"session {session.session_id} (epoch {session.current}, "
            f"high water {session.high_water or '-'})"
        )
        for record in mine:  # newest first
            mark = "*" if record.checkpoint_id == session.high_water else ""
            mark = mark or ("" if on_timeline(session, record) else "x")
            rows.append(
                (
                    mark,
                    record.checkpoint_id,
                    record.epoch,
                    record.boundary,
                    record.byte_length,
                    record.envelope_digest[:12],
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        if index in headers:
            print(headers[index], file=out)
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        print("  " + line, file=out)
    print(
        "(* its session's high water; x abandoned by a restore or a take-over, "
        "never restored by default)",
        file=out,
    )
    return EXIT_OK


def _demo_agent(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Not for users: the demo's remote agent, in the process the demo starts. It
    says ``ready`` on stdout, and stops with SIGTERM or when its stdin closes."""
    import anyio

    from .demo import serve_agent

    def ready() -> None:
        print("ready", file=out, flush=True)
        threading.Thread(target=_stop_when_stdin_closes, daemon=True).start()

    options = {"session": args.session, "name": args.name, "size": args.size, "seed": args.seed}
    url = os.environ["COORDINATOR_NATS_URL"]  # not in argv: `ps` shows argv
    connection = resolve(args, url=url)  # its credentials and TLS: NATS_* in its environment
    assert connection is not None
    connect_options = connection.options()
    anyio.run(lambda: serve_agent(url, ready=ready, connect_options=connect_options, **options))
    return EXIT_OK


def _stop_when_stdin_closes() -> None:
    """The demo holds our stdin: when it closes (the demo ended, however), stop.
    Read from the descriptor, not ``sys.stdin``: a daemon thread blocked holding
    the buffered reader's lock made the interpreter's exit on SIGTERM wait a
    second for it, then abort ("could not acquire lock ... at interpreter shutdown")."""
    with contextlib.suppress(OSError):
        while os.read(0, 1 << 16):
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def _demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .demo import run_demo, summary_json, summary_text

    live = None if args.json else out
    connection = resolve(args, default_url=None)  # None: the embedded server
    if args.dashboard is not None:
        return _demo_with_dashboard(args, connection, out, err)
    summary = _run_stoppable(
        lambda: run_demo(
            steps=args.steps, store_dir=args.store, out=live, keep=args.keep, connection=connection
        ),
        err,
    )
    print(summary_json(summary) if args.json else summary_text(summary), file=out)
    return EXIT_OK if summary.world_identical else EXIT_FAILED


_STOPPING = (
    "coordinator: stopping in order (the writer, the store, the remote agent, the NATS "
    "server: each bounded, about 2 s in all); Ctrl-C again quits at once"
)


def _run_stoppable(function: Callable[[], Awaitable[T]], err: TextIO) -> T:
    """``anyio.run(function)``, where a Ctrl-C (a SIGTERM becomes one) cancels it
    once and lets it stop in order, each of its waits bounded. Another Ctrl-C
    while it stops (``timeout -s INT`` sends two: to the process and its group)
    says what it is doing instead of cutting the stop short, which left threads
    blocked and the interpreter waiting for them at exit; a third quits at once."""
    import asyncio

    import anyio

    if threading.current_thread() is not threading.main_thread():
        return anyio.run(function)  # (signals reach the main thread only)
    interrupts: list[int] = []
    running: list[tuple[asyncio.AbstractEventLoop, anyio.CancelScope]] = []
    done: list[bool] = []

    def on_interrupt(signum: int, frame: object) -> None:
        interrupts.append(signum)
        if done:  # it has stopped: the interrupt is reported once the loop is closed
            return
        if not running:  # not started yet: it stops as it starts (raised here, the
            return  # KeyboardInterrupt could cut the event loop's making short)
        if len(interrupts) == 1:
            loop, scope = running[0]
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(scope.cancel)
        elif len(interrupts) == 2:
            print(_STOPPING, file=err, flush=True)
        else:
            os._exit(EXIT_INTERRUPTED)

    async def guarded() -> T | None:
        # A scope, not one task.cancel(): Python 3.11's asyncio.wait_for (nats-py's
        # every request) returns a reply that came with the cancellation and drops
        # the cancellation; a scope's is delivered again until the scope is left.
        with anyio.CancelScope() as scope:
            running.append((asyncio.get_running_loop(), scope))
            if interrupts:  # (one came while the loop was made)
                scope.cancel()
            try:
                return await function()
            finally:
                done.append(True)
        return None

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        result = anyio.run(guarded)
    except BaseException:
        if interrupts:  # whatever the stop raised (a cancellation, mostly): interrupted
            raise KeyboardInterrupt from None
        raise
    finally:
        # Interrupted, the process is on its way out (130): a late Ctrl-C (the second of
        # a pair that came after the stop) must not turn that into a KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.SIG_IGN if interrupts else previous)
    if interrupts:
        raise KeyboardInterrupt
    return cast(T, result)


def _listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _check_listen(args: argparse.Namespace, err: TextIO) -> tuple[str, int] | None:
    """The address, if it is loopback or remote access was asked for explicitly;
    ``None`` (and a line on ``err``) if not, or if the web extra is missing."""
    import importlib.util

    host, port = args.listen if args.listen else args.dashboard
    if host == "localhost":  # bound to loopback itself, whatever the name resolves to
        host = "127.0.0.1"
    if not _is_loopback(host) and not args.allow_remote:
        print(f"coordinator: {host} is not loopback: the dashboard shows every session's save "
              "state to whoever reaches it; pass --allow-remote to mean it", file=err)  # fmt: skip
        return None
    if not all(importlib.util.find_spec(name) for name in ("starlette", "uvicorn")):
        print("coordinator: the dashboard needs the web extra: from a checkout of the "
              "project, pip install '.[web]'", file=err)  # fmt: skip
        return None
    return host, port


def _is_loopback(host: str) -> bool:
    """An address literal in 127.0.0.0/8 or ::1 (a name is not trusted to be one)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int, err: TextIO) -> Any:
    """The dashboard's socket, listening; ``None`` and one line on ``err`` if it
    cannot be had (the address in use: another dashboard, or another program)."""
    from .dashboard import listening_socket

    try:
        return listening_socket(host, port)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        print(f"coordinator: cannot listen on {host}:{port}: {reason}", file=err)
        return None


def _setup(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Make (or check) every stream and bucket a fleet uses, as an administrator,
    so that no role needs to create one (docs/operations.md, "Threat model")."""
    import anyio

    from .account import prepare_account
    from .bus import NatsBus

    connection = resolve(args)
    assert connection is not None

    async def run() -> tuple[str, ...]:
        async with NatsBus(connection.url, replicas=args.replicas, **connection.options()) as bus:
            return (await prepare_account(bus)).streams

    for stream in anyio.run(run):
        print(f"ready: {stream}", file=out)
    return EXIT_OK


def _web_missing(err: TextIO) -> bool:
    """Whether the dashboard's own dependencies (the ``web`` extra) are missing:
    then one line says how to install them, where an import error came out."""
    import importlib.util

    missing = [name for name in ("starlette", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(name) is None]  # fmt: skip
    if missing:
        # (not 'coordinator[web]': PyPI's 'coordinator' is another project)
        print(f"coordinator: the dashboard needs the web extra ({', '.join(missing)} "
              f"missing): pip install {' '.join(missing)} (from a checkout: "
              "pip install '.[web]')", file=err)  # fmt: skip
    return bool(missing)


def _dashboard(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Serve the live save-state page until Ctrl-C."""
    import anyio

    if _web_missing(err):
        return EXIT_USAGE
    from .dashboard import serve

    address = _check_listen(args, err)
    if address is None:
        return EXIT_USAGE
    host, port = address
    connection = resolve(args)
    assert connection is not None
    away = anyio.run(_check_reader, connection)
    sock = _bind(host, port, err)
    if sock is None:
        return EXIT_ADDRESS
    if away is not None:  # one line now; the page says it too, and the server retries
        print(f"coordinator dashboard: {away}; serving the page anyway: it shows the bus as "
              "unavailable and retries every few seconds until the server answers",
              file=err, flush=True)  # fmt: skip

    async def run() -> None:
        ready = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(
                partial(
                    serve,
                    connection.url,
                    host,
                    port,
                    ready=ready,
                    remote=args.allow_remote,
                    sock=sock,
                    max_sessions=args.metrics_sessions,
                    connect_options=connection.options(),
                )
            )
            await ready.wait()
            print(f"dashboard: http://{host}:{port}/ (following {connection.redacted}; "
                  "Ctrl-C to stop)", file=out, flush=True)  # fmt: skip

    with contextlib.suppress(KeyboardInterrupt):  # (it runs until stopped: its normal end)
        _run_stoppable(run, err)
    return EXIT_OK


async def _check_reader(connection: Connection) -> str | None:
    """Before the dashboard serves: credentials the server refuses, or a user who
    may not read the events, are one line now, not a page that says "unavailable"
    for ever. A server that is away is left to the page, which retries: returned
    is why it is away (``None``: it answered)."""
    from .bus import NatsBus

    try:
        async with NatsBus(
            connection.url, connect_timeout=5, read_only=True, **connection.options()
        ) as bus:
            await (await bus.subscribe()).aclose()
    except BusRefusedError:
        raise
    except BusUnavailableError as error:
        return str(error) or f"cannot reach NATS at {connection.redacted}"
    return None


def _demo_with_dashboard(
    args: argparse.Namespace, connection: Connection | None, out: TextIO, err: TextIO
) -> int:
    """The demo, with the dashboard beside it (it stays up after: Ctrl-C to stop)."""
    import anyio

    if _web_missing(err):
        return EXIT_USAGE
    from .dashboard import serve
    from .demo import run_demo, summary_text
    from .server import EmbeddedServer

    args.listen = None
    address = _check_listen(args, err)
    if address is None:
        return EXIT_USAGE
    host, port = address
    sock = _bind(host, port, err)
    if sock is None:
        return EXIT_ADDRESS

    async def run() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if connection is None:
                url = (await stack.enter_async_context(EmbeddedServer())).url
                options: dict[str, Any] = {}
                shown, what = url, "embedded nats-server"
            else:
                url, options = connection.url, connection.options()
                shown, what = connection.redacted, "nats-server"
            ready = anyio.Event()
            async with anyio.create_task_group() as group:
                group.start_soon(
                    partial(serve, url, host, port, ready=ready, remote=args.allow_remote,
                            sock=sock, connect_options=options)
                )  # fmt: skip
                await ready.wait()
                print(f"dashboard: http://{host}:{port}/", file=out, flush=True)
                print(f"{what} at {shown} (coordinator watch --nats {shown} follows it)",
                      file=out, flush=True)  # fmt: skip
                summary = await run_demo(
                    steps=args.steps, store_dir=args.store, nats_url=url, out=out, keep=args.keep,
                    connection=connection,
                )  # fmt: skip
                print(summary_text(summary), file=out)
                print("the dashboard stays up: Ctrl-C to stop", file=out, flush=True)
                demo_done.append(True)

    demo_done: list[bool] = []
    try:
        _run_stoppable(run, err)
    except KeyboardInterrupt:
        if not demo_done:
            raise  # the demo was cut short: interrupted (130, or 143 for a SIGTERM)
    return EXIT_OK  # (the dashboard that stayed up ends when stopped: its normal end)


def _restore(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Verify a generation and write its payloads as files: all of them or none,
    durably (see ``coordinator.store.export_payloads``)."""
    from .store import SyncStore, export_payloads

    target = Path(args.to).absolute()
    if target.exists():
        print(f"coordinator: {target} exists; restore writes a new directory", file=err)
        return EXIT_USAGE
    unreachable = _unwritable_parent(target)
    if unreachable is not None:  # found before anything is read or fetched
        print(f"coordinator restore: cannot write {target}: {unreachable}", file=err)
        return EXIT_UNREADABLE
    if isinstance(args.store, str):
        return _restore_replica(args, target, out, err)
    if flags := given(args):  # (the environment's NATS_* are for a nats:// source only)
        print(f"coordinator restore: {flags[0]} is for a nats:// source", file=err)
        return EXIT_USAGE
    if target.resolve().is_relative_to(args.store.resolve()):
        print(f"coordinator: {target} is inside the store; restore writes elsewhere", file=err)
        return EXIT_USAGE
    ids = {"--checkpoint": [args.checkpoint], "--session": [args.session]}
    if _refused_ids("restore", ids, err):
        return EXIT_USAGE
    with SyncStore(_store(args.store), read_only=True, create=False) as store:
        stored = store.read(store.select(args.checkpoint, session_id=args.session))
    with stored:
        try:
            count = export_payloads(stored, str(target), mode=args.mode)
        except (CommitError, OSError) as error:
            if isinstance(error, FileExistsError):
                raise
            reason = os.strerror(error.errno) if error.errno else str(error)
            code = error.code if isinstance(error, CommitError) else "os"
            print(f"coordinator restore: FAILED [{code}] cannot write {target}: {reason}",
                  file=err)  # fmt: skip
            # A path that cannot be reached is status 3, as the table says; a disk that
            # fails the write (no space, I/O error) is a command that did not do its work.
            return EXIT_UNREADABLE if error.errno in _PATH_ERRNOS else EXIT_FAILED
        size = stored.envelope.layout.file_bytes
    print(
        f"restored {stored.record.checkpoint_id} ({count} payloads, envelope {size} bytes) "
        f"to {target}",
        file=out,
    )
    return EXIT_OK


_PATH_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM)


def _unwritable_parent(target: Path) -> str | None:
    """Why ``restore --to target`` cannot make ``target`` (its parent is missing,
    or is no directory), or ``None``: restore makes the directory, not its parents."""
    parent = target.parent
    try:
        mode = os.stat(parent).st_mode
    except OSError as error:
        return f"{parent}: {error.strerror or error} (restore makes the directory, not its parents)"
    return None if stat.S_ISDIR(mode) else f"{parent}: {os.strerror(errno.ENOTDIR)}"


def _restore_replica(args: argparse.Namespace, target: Path, out: TextIO, err: TextIO) -> int:
    """The session's replicated generation, fetched from the bucket, verified by
    every reader check, and written out like a local one."""
    import anyio

    from .bus import connect
    from .replicate import Replicas
    from .store import export_payloads

    if args.checkpoint is not None:
        print("coordinator restore: the replicated tier keeps the pointed generation "
              "only: leave out --checkpoint", file=err)  # fmt: skip
        return EXIT_USAGE
    connection = resolve(args, url=args.store)
    assert connection is not None
    if args.session is None or not is_id(args.session):
        held = anyio.run(_replicated_sessions, connection)
        print(f"coordinator restore: a NATS source needs --session (an Id); {held}", file=err)
        return EXIT_USAGE
    denied: list[str] = []
    reading: list[anyio.CancelScope] = []  # (made in the event loop)

    async def note_denials(error: Exception) -> None:
        """nats-py's background errors during a one-shot read: what fails, fails the
        read; a permissions violation ends it at once (the request would only wait
        for its timeout), and says why. Deleting a consumer when done is best
        effort (a reader need not be allowed to: operations.md, "Permission sets")."""
        said = str(error).lower()
        if "permissions violation" in said and "$js.api.consumer.delete." not in said:
            denied.append(str(error).removeprefix("nats: "))
            for scope in reading:
                scope.cancel()

    async def fetch() -> Any:
        # A plain connection: a read creates nothing (no stream, no bucket), so a
        # read-only credential is enough.
        client = await connect([connection.url], 3.0, error_cb=note_denials, **connection.options())
        try:
            with anyio.CancelScope() as scope:
                reading.append(scope)
                return await (await Replicas(client).open()).fetch(args.session)
        except Exception:
            if not denied:
                raise
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await client.close()

    stored = anyio.run(fetch)
    if denied:  # (nats-py reports the server's line lowercased)
        raise BusRefusedError(f"permission denied: the server says {denied[0]}")
    with stored:
        count = export_payloads(stored, str(target), mode=args.mode)
        size = stored.envelope.layout.file_bytes
    print(
        f"restored {stored.record.checkpoint_id} of session {args.session} from "
        f"{connection.redacted} "
        f"({count} payloads, envelope {size} bytes, verified) to {target}",
        file=out,
    )
    return EXIT_OK


async def _replicated_sessions(connection: Connection) -> str:
    """The sessions the replicated tier holds, said for a usage error: at most
    a few seconds, and never an error of its own."""
    import anyio

    from .bus import connect
    from .errors import ReplicaBucketMissingError
    from .replicate import Replicas

    try:
        with anyio.fail_after(5):
            client = await connect([connection.url], 3.0, error_cb=None, **connection.options())
            try:
                pointers, _, _ = await (await Replicas(client).open()).pointers.every()
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await client.close()
    except ReplicaBucketMissingError:
        return f"{connection.redacted} holds no replicated session (no replicas bucket)"
    except Exception as error:  # (TimeoutError included)
        return f"its sessions could not be listed: {error or type(error).__name__}"
    if not pointers:
        return f"{connection.redacted} holds no replicated session"
    names = sorted(pointers)
    more = f", ... ({len(names)} in all)" if len(names) > 20 else ""
    return f"{connection.redacted} holds: {', '.join(names[:20])}{more}"


WATCH_HELD = 4096  # live messages held for watch's fold (while the history is read)
WATCH_HELD_BYTES = 32 << 20  # ... and their bytes: beyond either, lost and counted
WATCH_DRAWS_S = 0.125  # a terminal's table is made again at most this often
WATCH_PRINTS_S = 1.0  # a pipe gets the table again at most this often while following


def _watch(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Replay the stream's history, then follow live events, folding them into save
    state by the documented rules (``monitor.Fleet``: bounded, whatever is
    published). --json: one folded session state per event, for scripts."""
    import anyio

    from .bus import NatsBus

    if _refused_ids("watch", {"--session": args.session or []}, err):
        return EXIT_USAGE
    connection = resolve(args)
    assert connection is not None
    screen = _Screen(out, json_lines=args.json, replay_only=args.replay_only)

    async def follow() -> None:
        try:
            await follow_bus()
        finally:  # (helper-73: a replay said "1 contradicting" of 19, the rest untold)
            assert screen.fleet.notices is not None
            screen.fleet.notices.flush()

    async def follow_bus() -> None:
        sessions = args.session or [None]
        async with (
            NatsBus(connection.url, read_only=True, **connection.options()) as bus,
            contextlib.AsyncExitStack() as showing,
        ):
            screen.feed.bus = bus
            # A typo, or a host not started yet: said, never an empty table alone.
            await _say_silent(bus, args.session or [], args.replay_only, err)
            if screen.live_table:  # the table appears once the server answers
                showing.enter_context(screen.display)
            if not args.replay_only:  # subscribed first: nothing falls between the two
                for session in sessions:
                    subscription = await bus.subscribe(session, raw=screen.feed.put)
                    await showing.enter_async_context(subscription)
            for session in sessions:
                async for batch in bus.history_messages(session):
                    for data in batch:
                        screen.receive(data)
            screen.replayed()
            if args.replay_only:
                return
            async with anyio.create_task_group() as group:
                group.start_soon(_until_reader_gone, out)
                group.start_soon(screen.tell_lost)
                group.start_soon(_follow_beats, bus, screen)
                async for data in screen.feed:  # (what the history had is rule 2's duplicate)
                    screen.receive(data, live=True)

    _run_stoppable(follow, err)
    return EXIT_OK


class _Screen:
    """What watch shows of its fold: a JSON line per event folded (``--json``), or
    the table: on a terminal made again at most every ``WATCH_DRAWS_S``; into a
    pipe, which cannot be redrawn (Live would print nothing until the end), after
    the history and again as live events come, at most every ``WATCH_PRINTS_S``
    (a flood would print a table an event)."""

    def __init__(self, out: TextIO, *, json_lines: bool, replay_only: bool) -> None:
        from rich.live import Live

        from .monitor import Fleet, Notices, render
        from .presence import Deafness, liveness

        self.json_lines, self.replay_only = json_lines, replay_only
        self.out, self.console = out, _console(out)
        self.fleet = Fleet(notices=Notices())
        self.beats: dict[str, Presence] = {}  # the hosts' presence
        self.deafness = Deafness()  # when NATS could not be heard: no silence of the hosts
        self.feed = _Feed()
        self.render = render
        self.display = Live(render(self.fleet), console=self.console, refresh_per_second=8,
                            transient=False)  # fmt: skip
        self.live_table = not json_lines and self.console.is_terminal
        self.drawn_at, self.pending = 0.0, False
        self.liveness = liveness
        self.hosts_drawn: dict[str, str] = {}  # each host's state in the last table

    def table(self) -> Any:
        beats = None if self.replay_only else self.beats
        width = self.console.width if self.console.is_terminal else None  # (a pipe: all)
        return self.render(
            self.fleet, beats, dropped=self.feed.lost(), deafness=self.deafness, width=width
        )

    def hearing(self, connected: bool) -> bool:
        """Whether the connection is up (and NATS answers round trips: the bus's
        ``follow_answers``): while it is not heard, a host's silence is no sign of
        it, and the table says so. True when NATS is heard again after an outage."""
        deafness, now = self.deafness, time.time()
        if not deafness.last_answer:  # (no round trip asked yet: nothing to judge by)
            return False
        was = deafness.since
        if connected and not deafness.unanswered(now):
            deafness.regained(now)
        else:
            deafness.lost(min(now, deafness.last_answer))
        if deafness.since != was:  # (a pipe, too, gets a table saying so)
            self.pending = True
            if self.json_lines:  # (meanwhile no host is judged by its silence)
                from .presence import rfc3339_at

                since = None if deafness.since is None else rfc3339_at(deafness.since)
                print(json.dumps({"nats": {"heard": since is None, "lostSince": since}}),
                      file=self.out, flush=True)  # fmt: skip
        return was is not None and deafness.since is None

    def receive(self, data: bytes, *, live: bool = False) -> None:
        folded = self.fleet.receive(data)
        if folded is None:
            return
        if self.json_lines:  # (the fold's own bookkeeping, ids and missing seqs, left out)
            shown = msgspec.to_builtins(folded)
            for internal in ("folded", "foldedSeqs", "missing", "straySeq", "strayRun"):
                shown.pop(internal, None)
            print(json.dumps(shown), file=self.out, flush=True)
            return
        self.pending = True
        # (a pipe gets the history's table once, at its end)
        due = WATCH_PRINTS_S if live else math.inf
        if time.monotonic() - self.drawn_at >= (WATCH_DRAWS_S if self.console.is_terminal else due):
            self._draw(self.table())

    async def tell_lost(self) -> None:
        """Each second: live messages lost under a flood (the feed held too many, or
        nats-py dropped them) are logged with what was not adopted, a line now and
        then, and the last of a burst too."""
        import anyio

        notices = self.fleet.notices
        assert notices is not None
        told = 0
        while True:
            lost = self.feed.lost()
            if lost > told:
                notices.note("live messages lost (a slow reader; the stream has them)",
                             count=lost - told)  # fmt: skip
                told = lost
            notices.tick()
            await anyio.sleep(1)

    def replayed(self) -> None:
        """The history is folded: its table, once."""
        if not self.json_lines:
            self.pending = True
            self._draw(self.table())

    def redraw(self) -> None:
        """Each second while following: time alone moves a host's state. A pipe
        gets a table when a host's state changed since the last one (a host
        going quiet is no event: a log's last word on a killed one was `alive`);
        ``--json``, a line for each host whose state changed."""
        if self.json_lines:
            self._print_hosts()
            return
        if not self.console.is_terminal and self._hosts() != self.hosts_drawn:
            self.pending = True
        if self.console.is_terminal or self.pending:
            self._draw(self.table())

    def keep_beat(self, beat: Presence) -> None:
        """A host's beat, as read now. A session with a row is always kept
        (helper-62: beats of made-up sessions, first come, kept the real hosts
        out), others while there is room; an older beat never replaces a newer
        (helper-64: one forged beat of 2000 turned a live host gone); and once
        the table holds twice the fold's sessions, the beats of sessions the fold
        let go are dropped (helper-64: it grew without bound)."""
        from .monitor import MAX_SESSIONS
        from .presence import as_read, epoch_seconds, supersedes

        session, read = beat.session_id, as_read(beat, time.time())
        kept, rows = self.beats.get(session), self.fleet.sessions
        if kept is not None and not supersedes(epoch_seconds(read.time), epoch_seconds(kept.time)):
            return
        if kept is None and session not in rows and len(self.beats) >= MAX_SESSIONS:
            return
        self.beats[session] = read
        if len(self.beats) > 2 * MAX_SESSIONS:
            for other in [s for s in self.beats if s not in rows]:
                del self.beats[other]

    def _hosts(self) -> dict[str, str]:
        """The state of each host the table shows (a session with a row: beats of
        others, not followed or with no event, change nothing in it) as it would
        show it now."""
        now, rows = time.time(), self.fleet.sessions
        return {s: self.liveness(b, now, self.deafness) for s, b in self.beats.items() if s in rows}

    def _print_hosts(self) -> None:
        """``{"host": {"sessionId", "state", "beat"}}`` for each host whose state
        changed (its beat as read: the host's own words, JSON-escaped)."""
        hosts = self._hosts()
        for session, state in sorted(hosts.items()):
            if self.hosts_drawn.get(session) != state:
                beat = msgspec.to_builtins(self.beats[session])
                line = {"host": {"sessionId": session, "state": state, "beat": beat}}
                print(json.dumps(line), file=self.out, flush=True)
        self.hosts_drawn = hosts

    def _draw(self, table: Any) -> None:
        if self.console.is_terminal:
            self.display.update(table)
        elif self.pending:
            self.console.print(table)
        self.drawn_at, self.pending = time.monotonic(), False
        self.hosts_drawn = self._hosts()


class _Feed:
    """Live messages between nats-py's callback and watch's fold: at most
    ``WATCH_HELD`` messages and ``WATCH_HELD_BYTES`` bytes held, while the history
    is read or when the fold falls behind a flood; what is beyond is lost and
    counted (shown under the table), never held without bound."""

    def __init__(self) -> None:
        import anyio

        self._send, self._receive = anyio.create_memory_object_stream[bytes](WATCH_HELD)
        self.held_bytes = 0
        self.dropped = 0
        self.bus: Any = None

    async def put(self, data: bytes) -> None:
        import anyio

        if self.held_bytes + len(data) > WATCH_HELD_BYTES:
            self.dropped += 1
            return
        try:
            self._send.send_nowait(data)
        except anyio.WouldBlock:
            self.dropped += 1
            return
        self.held_bytes += len(data)

    def lost(self) -> int:
        """Live messages lost: held too many, or nats-py dropped them (slow consumer)."""
        return self.dropped + (self.bus.counts().get("dropped", 0) if self.bus else 0)

    async def __aiter__(self) -> Any:
        async for data in self._receive:
            self.held_bytes -= len(data)
            yield data


def _refused_ids(command: str, given: dict[str, list[str | None]], err: TextIO) -> bool:
    """A flag's value that is no Id (a wildcard would follow other sessions; a path,
    another file): said, as itself, not as an id nobody has."""
    for flag, values in given.items():
        for value in values:
            if value is not None and not is_id(value):
                error = InvalidScalarError("Id", value)
                print(f"coordinator {command}: FAILED [{error.code}] {flag}: {error}", file=err)
                return True
    return False


def _console(out: TextIO) -> Console:
    """watch's rich console: a closed pipe raises BrokenPipeError, as any write's
    does (rich's own handler exits 1)."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True  # (nothing more is written)
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return PipeConsole(file=out, width=None if out.isatty() else 220)  # pipes: no folding


async def _say_silent(bus: Any, followed: list[str], replay_only: bool, err: TextIO) -> None:
    """One line on ``err``, before the table, for each followed session the stream
    holds no event of, naming the sessions it holds (from its subjects: one
    STREAM.INFO, which a reader may make; nothing is said if the server won't)."""
    from .events import session_subjects

    silent = []
    for session in followed:  # (a filter of one session's subjects: a small answer)
        if await _sessions_on_stream(bus, session_subjects(session, prefix=bus.prefix)) == []:
            silent.append(session)
    known = await _sessions_on_stream(bus) if silent else None  # (every session: only now)
    if known is None:
        return
    more = ", ..." if len(known) > 20 else ""
    holds = f" (the stream holds {', '.join(known[:20]) or 'no session'}{more})"
    then = "nothing to replay" if replay_only else "waiting for its first event (Ctrl-C to stop)"
    for session in silent:
        print(f"coordinator watch: no events of session {session}{holds}; {then}",
              file=err, flush=True)  # fmt: skip


async def _sessions_on_stream(bus: Any, subjects: str | None = None) -> list[str] | None:
    """The sessions the event stream holds events of on ``subjects`` (default: all),
    from its subjects (``<prefix>.<session>.<event>``), or ``None`` if the server
    does not say."""
    import anyio

    from .events import session_of_token

    try:
        with anyio.fail_after(3):
            info = await bus.client.jetstream().stream_info(
                bus.stream, subjects_filter=subjects or f"{bus.prefix}.>"
            )
    except Exception:
        return None
    head = f"{bus.prefix}."
    tokens = {subject.removeprefix(head).split(".")[0] for subject in info.state.subjects or {}}
    # (anyone may publish on a subject whose token is no Id, and holds escapes)
    return sorted(s for s in map(session_of_token, tokens) if is_id(s))


async def _follow_beats(bus: Any, screen: _Screen) -> None:
    """``watch``'s host column: the hosts' beats as they come (of at most as many
    sessions as the fold keeps: anyone may put beats), and the table drawn again
    each second, since time alone turns a silent host late, then gone (but not
    while NATS cannot be heard: ``_Screen.hearing``)."""
    import anyio

    reading: list[anyio.CancelScope] = []

    async def follow() -> None:
        """Asked again every 2 s while the server has no hosts' bucket (no host
        beat on it yet; helper-53: a watch begun first showed `-` for good), or
        the read fails (no right to read them: the column says -); and at once
        once NATS is heard again (helper-62: the watcher kept over an outage
        delivered beats again only seconds later, the live hosts gone meanwhile)."""
        while True:
            with anyio.CancelScope() as scope:
                reading[:] = [scope]
                with contextlib.suppress(Exception):
                    async for beat in bus.presence():
                        screen.keep_beat(beat)
                await anyio.sleep(2)

    screen.deafness.answered(time.time())  # (the connection was just used: heard)
    async with anyio.create_task_group() as group:
        group.start_soon(follow)
        group.start_soon(bus.follow_answers, screen.deafness)  # (a partition is silent)
        while True:
            if screen.hearing(bus.client.is_connected):
                for scope in reading:  # (the beats afresh)
                    scope.cancel()
            screen.redraw()
            await anyio.sleep(1)


async def _until_reader_gone(out: TextIO) -> None:
    """While following live, a pipe whose reader went away (``| head -1``) would only
    be noticed at the next event: poll it, and end as a write to it would."""
    import select

    import anyio

    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a test's StringIO)
    watcher = select.poll()
    watcher.register(fd, select.POLLERR)
    while True:
        if any(events & (select.POLLERR | select.POLLHUP) for _, events in watcher.poll(0)):
            raise BrokenPipeError(errno.EPIPE, "the reader of standard output went away")
        await anyio.sleep(0.5)


def _schema(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .events import events_schema

    print(json.dumps(events_schema(), indent=2, sort_keys=True), file=out)
    return EXIT_OK


def _bench(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .bench import GROUPS, render, report
    from .bench.progress import shown_on

    groups = list(GROUPS) if args.group == "all" else [args.group]
    for group in groups:
        # Progress on stderr only when it is a terminal, never with --json; its lines
        # are cleared before the group's report is printed.
        with shown_on(err, group, enabled=not args.json) as progress:
            if group == "soak":  # counted in checkpoints or hours, not bytes and runs
                from .bench.soak import run as soak

                results = soak(checkpoints=args.checkpoints, hours=args.hours, progress=progress)
            else:
                results = GROUPS[group](args.size, args.runs, progress)
        document = report(group, results)
        print(json.dumps(document) if args.json else render(document), file=out)
    return EXIT_OK


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("checkpoint-coordinator")
    except PackageNotFoundError:
        return "(not installed)"


def _agent_parser() -> argparse.ArgumentParser:
    """``coordinator demo-agent``: the demo's worker. Not a user's command, so not
    among the parser's (an unknown command's error never lists it)."""
    agent = argparse.ArgumentParser(prog="coordinator demo-agent")
    agent.add_argument("--session", required=True)
    agent.add_argument("--name", required=True)
    agent.add_argument("--size", type=int, required=True)
    agent.add_argument("--seed", type=int, required=True)
    agent.set_defaults(run=_demo_agent, command="demo-agent")
    return agent


_URL_HELP = "the NATS server URL (default: NATS_URL, else nats://127.0.0.1:4222)"


def _command(
    commands: Any, name: str, *, help: str, examples: Sequence[str], note: str = ""
) -> argparse.ArgumentParser:
    """A subcommand whose --help keeps its lines: the description, then each
    example on a line of its own (argparse would run them together)."""
    label = "Example" if len(examples) == 1 else "Examples"
    epilog = f"{label}:\n" + "\n".join(f"  {example}" for example in examples)
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=help,
        description=help[:1].upper() + help[1:] + "." + (f"\n\n{note}" if note else ""),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _add_demo(commands: Any) -> None:
    demo = _command(
        commands,
        "demo",
        help="run a simulation host on an embedded NATS server: save, watch, restore",
        examples=[
            "coordinator demo --steps 60 --store ./saves",
            "coordinator demo --dashboard        # and its live page at http://127.0.0.1:8321/",
        ],
    )
    demo.add_argument("--steps", type=_positive, default=60, help="simulation steps (60)")
    demo.add_argument("--store", default=None, help="store directory (default: a new temp dir)")
    add_options(demo, url_help="use this NATS server instead of an embedded one (or NATS_URL)")
    demo.add_argument("--json", action="store_true", help="print only a JSON summary")
    demo.add_argument(
        "--keep", action="store_true", help="keep the temporary store (with --store: always kept)"
    )
    demo.add_argument("--dashboard", type=_listen, nargs="?", const=("127.0.0.1", 8321),
                      default=None, metavar="HOST:PORT",
                      help="serve the live dashboard beside the demo (127.0.0.1:8321)")  # fmt: skip
    demo.add_argument("--allow-remote", action="store_true",
                      help="the dashboard may listen on a non-loopback address")  # fmt: skip
    demo.set_defaults(run=_demo)


def _add_setup(commands: Any) -> None:
    setup = _command(
        commands,
        "setup",
        help="make every stream and bucket a fleet uses (or check them), as an administrator",
        examples=["coordinator setup --nats nats://nats.example:4222 --creds admin.creds"],
        note="Run it once before the first host in an account others share: the roles' "
        "permission sets then need no right to create a stream (docs/operations.md). "
        "What exists is checked, never changed.",
    )
    add_options(setup, url_help=_URL_HELP)
    setup.add_argument("--replicas", type=_positive, default=1,
                       help="replicas of each stream it makes (1; 3 on a cluster)")  # fmt: skip
    setup.set_defaults(run=_setup)


def _add_dashboard(commands: Any) -> None:
    dashboard = _command(
        commands,
        "dashboard",
        help="a live web page of save state on a NATS server (read-only)",
        examples=["coordinator dashboard --nats nats://127.0.0.1:4222 --listen 127.0.0.1:8321"],
        note="A server that cannot be reached now is said on one line; the page retries.",
    )
    add_options(dashboard, url_help=_URL_HELP)
    dashboard.add_argument("--listen", type=_listen, default=("127.0.0.1", 8321),
                           metavar="HOST:PORT", help="where to serve (127.0.0.1:8321)")  # fmt: skip
    dashboard.add_argument("--metrics-sessions", type=_positive, default=500,
                           help="sessions with series of their own on /metrics (500); "
                           "the rest count in the fleet's totals")  # fmt: skip
    dashboard.add_argument("--allow-remote", action="store_true",
                           help="listen on an address that is not loopback")  # fmt: skip
    dashboard.set_defaults(run=_dashboard, dashboard=None)


def _parser() -> argparse.ArgumentParser:
    from .bench import GROUPS

    parser = argparse.ArgumentParser(
        prog="coordinator",
        description="Checkpoint coordinator: FLYSESS1 envelopes and stores.",
        epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"coordinator {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    _add_demo(commands)

    _add_dashboard(commands)
    _add_setup(commands)

    inspect = _command(
        commands,
        "inspect",
        help="print an envelope's layout and manifest",
        examples=["coordinator inspect ./saves/ckpt-120.flysess --json"],
        note="A store directory is listed by `coordinator ls DIR`.",
    )
    inspect.add_argument("file", type=_path)
    inspect.add_argument("--json", action="store_true", help="one JSON object for machines")
    inspect.set_defaults(run=_inspect)

    verify = _command(
        commands,
        "verify",
        help="check an envelope file or every generation of a store; exit 0 if valid",
        examples=["coordinator verify ./saves", "coordinator verify ckpt-120.flysess"],
    )
    verify.add_argument("file", type=_path, metavar="FILE|STORE")
    verify.set_defaults(run=_verify)

    ls = _command(
        commands,
        "ls",
        help="list a store's generations, newest first",
        examples=["coordinator ls ./saves", "coordinator ls ./saves --json"],
        note="A checkpoint file is read by `coordinator inspect FILE`, `coordinator verify FILE`.",
    )
    ls.add_argument("store", type=_path)
    ls.add_argument("--json", action="store_true", help="one JSON object for machines")
    ls.set_defaults(run=_ls)

    restore = _command(
        commands,
        "restore",
        help="verify a generation and write its payloads to files (all or none)",
        examples=[
            "coordinator restore ./saves --to ./restored",
            "coordinator restore ./saves --checkpoint ckpt-120 --to ./restored",
            "coordinator restore nats://127.0.0.1:4222 --session s1 --to ./restored"
            "  # from any host",
        ],
        note="A nats:// source restores the session's replicated generation; without "
        "--session, the error lists the sessions it holds.",
    )
    restore.add_argument("store", type=_source, help="a store directory, or nats://HOST:PORT")
    restore.add_argument(
        "--checkpoint", default=None, help="checkpoint id (default: the session's high water)"
    )
    restore.add_argument(
        "--session", default=None, help="whose high water (needed when the store has several)"
    )
    restore.add_argument("--to", required=True, help="a new directory for the payload files")
    restore.add_argument(
        "--mode",
        type=_file_mode,
        default=None,
        help="the files' octal mode, say 640 for a group (default 600: the owner's alone; "
        "the directory follows: 750, 700)",
    )
    add_options(restore, url_help=None)  # (the URL is the source; NATS_URL is not read)
    restore.set_defaults(run=_restore)

    watch = _command(
        commands,
        "watch",
        help="follow save state on a NATS server: history first, then live",
        examples=[
            "coordinator watch --nats nats://127.0.0.1:4222",
            "coordinator watch --nats nats://127.0.0.1:4222 --session demo --replay-only",
        ],
        note="A --session with no events yet is said on stderr, with the sessions the "
        "stream holds;\nwatch then waits for its first event (--replay-only: exits 0).",
    )
    add_options(watch, url_help=_URL_HELP)
    watch.add_argument("--session", action="append", help="a session to follow (repeatable)")
    watch.add_argument("--json", action="store_true", help="one folded state line per event")
    watch.add_argument("--replay-only", action="store_true", help="replay the history, then exit")
    watch.set_defaults(run=_watch)

    schema = _command(
        commands,
        "schema",
        help="print a JSON Schema: events (the only one, and the default)",
        examples=["coordinator schema events > events.schema.json"],
    )
    schema.add_argument("what", nargs="?", choices=["events"], default="events",
                        help="the schema to print: events (default)")  # fmt: skip
    schema.set_defaults(run=_schema)

    bench = _command(
        commands,
        "bench",
        help="measure against same-run baselines",
        examples=[
            "coordinator bench envelope",
            "coordinator bench store --json --size 256MiB",
            "coordinator bench soak --json --hours 24",
        ],
    )
    bench.add_argument("group", choices=[*GROUPS, "all"])
    bench.add_argument("--json", action="store_true", help="one JSON object per group")
    bench.add_argument("--size", type=_size, default=1 << 30, help="bytes to move (default 1GiB)")
    bench.add_argument(
        "--runs", type=_positive, default=5, help="repetitions; the median is reported"
    )
    bench.add_argument("--checkpoints", type=_positive, default=100_000,
                       help="soak: checkpoints to take (default 100000)")  # fmt: skip
    bench.add_argument("--hours", type=_hours, default=None,
                       help="soak: run at least this long, too")  # fmt: skip
    bench.set_defaults(run=_bench)
    return parser


def main(
    argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """The command: its exit status. A closed stdout (``| head -1``) ends any command,
    and argparse's --help and --version, here: status 141, nothing more said."""
    out = out or sys.stdout or open(os.devnull, "w")  # noqa: SIM115 (stdout closed: `>&-`)
    try:
        status = _main(argv, out, err or sys.stderr)
        # Output into a pipe is buffered: flushed now, a closed pipe is said here, not
        # by the interpreter's last flush ("Exception ignored ...", status 120).
        for stream in (out, sys.stdout):
            if stream is not None:  # (None: started with stdout closed, `>&-`)
                stream.flush()
    except BrokenPipeError:
        return _pipe_closed(out, sys.stdout)
    except KeyboardInterrupt:  # (while its parser was made: before a command began)
        print("coordinator: interrupted", file=err or sys.stderr)
        return EXIT_INTERRUPTED
    return status


def _main(argv: Sequence[str] | None, out: TextIO, err: TextIO) -> int:
    _TERMINATED.clear()
    _quiet_asyncio_tls_noise()
    _quiet_nats_pong_noise()
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["demo-agent"]:
            args = _agent_parser().parse_args(argv[1:])
        else:
            args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    # SIGTERM stops a command the way Ctrl-C does: cleanly, servers and workers too.
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        previous = signal.signal(signal.SIGTERM, _interrupt)
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # started in the background
            signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return int(args.run(args, out, err))
    except CoordinatorError as error:
        where: Path | str = (
            getattr(args, "file", None)
            or getattr(args, "store", None)
            or f"coordinator {args.command}"
        )
        if isinstance(where, str):  # a URL's user and password are nobody's business
            where = redact(where)
        return _report_failure(error, where, err)
    except BrokenPipeError:
        raise  # (an OSError, but no file to name: main ends the command)
    except OSError as error:
        print(
            f"coordinator: cannot access {error.filename or ''}: {error.strerror or error}",
            file=err,
        )
        return EXIT_UNREADABLE
    except BaseExceptionGroup as group:  # from a task group: report the one real error
        if group.subgroup(BrokenPipeError) is not None:  # whatever else failed with it
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
        ours = _first_coordinator_error(group)
        if ours is None:  # not one of ours: still one line, never a task group's traceback
            leaf: BaseException = group
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            if not isinstance(leaf, Exception):
                raise
            print(f"coordinator {args.command}: FAILED [{type(leaf).__name__}] {leaf}", file=err)
            return EXIT_FAILED
        return _report_failure(ours, f"coordinator {args.command}", err)
    except KeyboardInterrupt:
        if _TERMINATED:
            print("coordinator: terminated", file=err)
            return EXIT_TERMINATED
        print("coordinator: interrupted", file=err)
        return EXIT_INTERRUPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _quiet_asyncio_tls_noise() -> None:
    """asyncio warns "returning true from eof_received() has no effect when using
    ssl" each time a TLS server closes a nats-py connection: noise that would make
    a command's one line two. Only that warning is dropped."""
    import logging

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "eof_received() has no effect when using ssl" not in record.getMessage()

    log = logging.getLogger("asyncio")
    if not any(isinstance(f, Quiet) or type(f).__name__ == "Quiet" for f in log.filters):
        log.addFilter(Quiet())


def _quiet_nats_pong_noise() -> None:
    """nats-py logs a traceback ("nats: encountered error ... InvalidStateError")
    when a PONG arrives for a flush that was cancelled meanwhile (a Ctrl-C while a
    connection flushes): its own bookkeeping, nothing of ours failed. Only that
    record is dropped."""
    import asyncio
    import logging

    class QuietPong(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            error = record.exc_info[1] if record.exc_info else None
            return not isinstance(error, asyncio.InvalidStateError)

    log = logging.getLogger("nats.aio.client")
    if not any(type(f).__name__ == "QuietPong" for f in log.filters):
        log.addFilter(QuietPong())


def _pipe_closed(*streams: TextIO) -> int:
    """The reader of our output went away (``coordinator ls | head``): end quietly,
    as other Unix tools do. What is still buffered goes to /dev/null at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in streams:
            with contextlib.suppress(OSError, ValueError, AttributeError):  # (no descriptor)
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)
    return EXIT_PIPE_CLOSED


_TERMINATED: list[int] = []  # a SIGTERM arrived: the interrupt it becomes exits 143


def _interrupt(signum: int, frame: object) -> None:
    _TERMINATED.append(signum)
    os.kill(os.getpid(), signal.SIGINT)


def _first_coordinator_error(group: BaseExceptionGroup[BaseException]) -> CoordinatorError | None:
    for error in group.exceptions:
        if isinstance(error, CoordinatorError):
            return error
        if isinstance(error, BaseExceptionGroup):
            found = _first_coordinator_error(error)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())

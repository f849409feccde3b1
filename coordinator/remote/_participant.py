"""Participants in other processes, over NATS request/reply.

The worker process serves its participant::

    await serve_participant("nats://host:4222", world, session_id="s1")

and the host's coordinator talks to it through a ``RemoteParticipant``::

    participants = [RemoteParticipant(bus, "world"), local_agent, ...]

A capture asks the worker, which captures, puts the bytes into the bus's
object bucket and answers with their length and SHA-256. The coordinator wraps
the object in an ``ObjectArtifact``; the writer reads and verifies it, commits
it, and the release deletes it. A restore goes the other way: the payload is
put as an object, the worker stages it (keeping its own token), and activates
or aborts on the next request.

Requests go to ``<rpc_prefix>.<session>.<participant>.<op>``; the prefix must
stay outside the event stream's subjects. The checkpoint manifest only ever
holds each payload's name, length and digest: no bucket, object or server.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from nats.aio.msg import Msg

from .._errors import CoordinatorError, RemoteWorkerError
from ..artifacts import ArtifactHandle, ArtifactLedger, owned_bytes
from ..bus._nats import NatsBus, connect, unmap
from ..events import subject_token
from ..ids import check_id, is_digest
from ..participant import CaptureScope, Participant, RestoreScope
from ._objects import DEFAULT_OBJECT_BUCKET, ObjectArtifact, ObjectBucket

__all__ = ["DEFAULT_RPC_PREFIX", "RemoteParticipant", "serve_participant"]

DEFAULT_RPC_PREFIX = "ckpt-rpc"

Op = Literal["capture", "stage", "activate", "abort"]


class Request(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    session_id: str
    epoch: str
    checkpoint_id: str
    step: int
    object: str = ""  # capture: where to put the bytes; stage: where they are
    byte_length: int = 0  # stage: what the object must hold
    digest: str = ""

    @classmethod
    def at(cls, scope: CaptureScope | RestoreScope, **fields: Any) -> Request:
        return cls(
            session_id=scope.session_id,
            epoch=scope.epoch,
            checkpoint_id=scope.checkpoint_id,
            step=scope.step,
            **fields,
        )


class Reply(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    ok: bool
    byte_length: int = 0
    digest: str = ""
    code: str = ""
    reason: str = ""


def _subject(prefix: str, session_id: str, participant: str, op: str) -> str:
    return f"{prefix}.{subject_token(session_id)}.{subject_token(participant)}.{op}"


class RemoteParticipant:
    """A participant served by another process (``serve_participant``).

    ``timeout`` bounds each request: a worker that died mid-capture is a
    ``RemoteWorkerError`` after it (the coordinator's capture then fails and
    fences the epoch, as for any participant). Keep it below the coordinator's
    ``capture_timeout`` (30 s by default), or a dead worker surfaces as that
    deadline instead of as ``remote.timeout``.
    """

    def __init__(
        self,
        bus: NatsBus,
        name: str,
        *,
        rpc_prefix: str = DEFAULT_RPC_PREFIX,
        timeout: float = 20.0,
    ) -> None:
        self.name = check_id(name)
        self.bus = bus
        self.rpc_prefix = rpc_prefix
        self.timeout = timeout

    async def capture_artifact(self, scope: CaptureScope, ledger: ArtifactLedger) -> ArtifactHandle:
        """The worker's capture, as a handle on the object it put in the bucket."""
        object_name = f"{scope.session_id}/{scope.checkpoint_id}/{self.name}"  # '/' is no Id's
        request = Request.at(scope, object=object_name)
        try:
            bucket = await self.bus.objects()
            reply = await self._request("capture", request)
        except BaseException:
            # A late worker may still finish its put: delete what it may leave
            # (the bucket's TTL takes what is put after this).
            self.bus.delete_object_soon(object_name)
            raise
        return ObjectArtifact(
            self.name,
            reply.byte_length,
            reply.digest,
            ledger,
            bucket=bucket,
            object_name=object_name,
            on_release=self.bus.delete_object_soon,
        )

    async def capture(self, scope: CaptureScope) -> bytes:
        """The captured bytes themselves, read back from the bucket."""
        handle = await self.capture_artifact(scope, ArtifactLedger())
        try:
            await handle.load()
            with handle.view() as view:
                return bytes(view)
        finally:
            handle.release()

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Request:
        bucket = await self.bus.objects()
        object_name = f"{scope.session_id}/restore/{scope.epoch}/{self.name}"
        request = Request.at(scope, object=object_name, byte_length=payload.nbytes)
        try:
            digest = await bucket.put(object_name, payload)
            request = msgspec.structs.replace(request, digest=digest)
            await self._request("stage", request)
        except BaseException:
            # The worker may have staged after all (a late answer): have it abort,
            # bounded and best effort, so it does not hold the state forever.
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(self.timeout),
                contextlib.suppress(Exception),
            ):
                await self._request("abort", request)
            raise
        finally:
            self.bus.delete_object_soon(object_name)
        return request

    async def activate_restore(self, token: Request) -> None:
        await self._request("activate", token)

    async def abort_restore(self, token: Request) -> None:
        await self._request("abort", token)

    async def _request(self, op: Op, request: Request) -> Reply:
        subject = _subject(self.rpc_prefix, request.session_id, self.name, op)
        try:
            message = await self.bus.client.request(
                subject, msgspec.json.encode(request), timeout=self.timeout
            )
        except nats.errors.NoRespondersError:
            raise RemoteWorkerError(
                self.name, "remote.no_worker", f"no worker serves {subject}"
            ) from None
        except (nats.errors.TimeoutError, TimeoutError):
            raise RemoteWorkerError(
                self.name,
                "remote.timeout",
                f"no answer to {op} within {self.timeout} s (the worker may have died)",
            ) from None
        try:
            reply = msgspec.json.decode(message.data, type=Reply)
        except msgspec.MsgspecError as error:
            raise RemoteWorkerError(self.name, "remote.protocol", str(error)) from None
        if not reply.ok:
            raise RemoteWorkerError(self.name, reply.code, reply.reason)
        if op == "capture" and (reply.byte_length < 0 or not is_digest(reply.digest)):
            raise RemoteWorkerError(self.name, "remote.protocol", f"a bad capture reply {reply}")
        return reply


async def serve_participant(
    servers: str | Sequence[str],
    participant: Participant,
    *,
    session_id: str,
    rpc_prefix: str = DEFAULT_RPC_PREFIX,
    object_bucket: str = DEFAULT_OBJECT_BUCKET,
    object_ttl: float = 3600.0,
    replicas: int = 1,
    connect_timeout: float = 5.0,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    **connect_options: Any,
) -> None:
    """Serve ``participant`` (the ``Participant`` protocol) for one session until
    cancelled. Requests are answered one at a time, in order."""
    check_id(session_id)
    check_id(participant.name)
    client = await connect(
        [servers] if isinstance(servers, str) else servers,
        connect_timeout,
        error_cb=_ignore,
        **connect_options,
    )
    try:
        bucket = await ObjectBucket.open(
            client.jetstream(), object_bucket, ttl=object_ttl, replicas=replicas
        )
        ping = _subject(rpc_prefix, session_id, participant.name, "ping")
        with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await client.request(ping, b"", timeout=1)
            raise RemoteWorkerError(
                participant.name, "remote.duplicate", f"another worker already serves {ping}"
            )
        worker = _Worker(participant, bucket)
        await client.subscribe(
            _subject(rpc_prefix, session_id, participant.name, "*"), cb=worker.answer
        )
        await client.flush()
        task_status.started()
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await client.close()


def _decode_request(data: bytes) -> Request:
    try:
        return msgspec.json.decode(data, type=Request)
    except msgspec.MsgspecError as error:
        raise RemoteWorkerError("?", "remote.protocol", f"a bad request: {error}") from None


async def _ignore(error: Exception) -> None:
    """The worker's connection errors: it reconnects; requests time out meanwhile."""


class _Worker:
    def __init__(self, participant: Participant, bucket: ObjectBucket) -> None:
        self.participant = participant
        self.bucket = bucket
        self.staged: dict[tuple[str, str], Any] = {}  # (epoch, checkpoint) -> token

    async def answer(self, message: Msg) -> None:
        op = message.subject.rsplit(".", 1)[-1]
        try:
            if op == "ping":  # another worker asking whether this participant is served
                reply = Reply(ok=True)
            else:
                reply = await self._do(op, _decode_request(message.data))
        except CoordinatorError as error:
            reply = Reply(ok=False, code=error.code, reason=str(error))
        except Exception as error:  # the participant's own failure, reported as is
            reply = Reply(ok=False, code="remote.failed", reason=repr(error))
        with contextlib.suppress(Exception):  # the requester gave up, or the bus is away
            await message.respond(msgspec.json.encode(reply))

    async def _do(self, op: str, request: Request) -> Reply:
        key = (request.epoch, request.checkpoint_id)
        if op == "capture":
            scope = CaptureScope(
                session_id=request.session_id,
                epoch=request.epoch,
                step=request.step,
                checkpoint_id=request.checkpoint_id,
            )
            data = await owned_bytes(await self.participant.capture(scope))
            with memoryview(data) as view:
                flat = view.cast("B") if view.format != "B" else view
                digest = await self.bucket.put(request.object, flat)
                return Reply(ok=True, byte_length=flat.nbytes, digest=digest)
        if op == "stage":
            restore = RestoreScope(
                session_id=request.session_id,
                epoch=request.epoch,
                checkpoint_id=request.checkpoint_id,
                step=request.step,
            )
            held = await self.bucket.read(request.object, request.byte_length, request.digest)
            try:
                with memoryview(held) as payload:
                    token = await self.participant.stage_restore(payload, restore)
            finally:
                if isinstance(held, mmap.mmap):  # freeing its pages takes a while: off the loop
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(unmap, held)
            replaced = self.staged.pop(key, None)
            if replaced is not None:  # staged twice: the first one is given up
                await self.participant.abort_restore(replaced)
            self.staged[key] = token
            return Reply(ok=True)
        if op in ("activate", "abort"):
            if key not in self.staged:
                raise RemoteWorkerError(self.participant.name, "remote.not_staged", f"{key}")
            token = self.staged.pop(key)
            if op == "activate":
                await self.participant.activate_restore(token)
            else:
                await self.participant.abort_restore(token)
            return Reply(ok=True)
        raise RemoteWorkerError(self.participant.name, "remote.protocol", f"unknown op {op!r}")

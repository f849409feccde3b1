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

Requests go to ``<rpc_prefix>.<session>.<participant>.<holder id>.<op>``; the
prefix must stay outside the event stream's subjects. The checkpoint manifest only ever
holds each payload's name, length and digest: no bucket, object or server.

**Sizes are bounded before allocation.** The host refuses a capture reply that
declares more than its ``max_bytes`` (``remote.too_large``) before it makes a
handle, and the worker refuses a stage request beyond its own ``max_bytes``
before it reads; the object reader then allocates only as chunks arrive.

**One worker per participant.** A worker holds a lease: a key per (session,
participant) in a KV bucket whose TTL is the lease's. It is taken with
``create`` (which fails if the key exists), refreshed every third of the TTL
with ``update(last=revision)``, and deleted (conditionally) on a clean exit; a
killed worker's key expires with the TTL. A second worker is refused
(``remote.duplicate``) at once if the holder answers a ping (on a subscription
of its own, so a busy worker still answers), else once the key outlives a
whole TTL or is refreshed. A worker that cannot refresh stops serving
(``remote.lease_lost``). Requests go to the holder's own subject (its id in
the lease), so a worker that lost the lease is not sent one. Every request
must name the served session and the objects' own shape
(``remote.bad_request`` otherwise).

**Only the lease holder answers.** NATS gives a request to every subscriber
whose subject matches, a wildcard one too, and ``request`` takes the first
answer: anyone allowed to subscribe could answer for the worker. So the worker
makes an Ed25519 key when it starts, publishes its public half in its lease
entry, and signs every reply over the request it answers (its subject: session,
participant, holder and op; its body: the host's fresh nonce and every field)
and every byte of the reply. The host verifies each answer with the key the
lease names, takes the first that verifies, and counts the others as forged
(``remote.forged`` when no signed one comes). A subscriber sees the request
and the public key but cannot sign; an old reply signs another nonce. A lease
without a key (an older worker) is refused (``remote.unsigned``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import mmap
import os
import socket
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, NoReturn, TypeVar

import anyio
import anyio.to_thread
import msgspec
import nats.errors
from anyio.abc import TaskStatus
from nacl.exceptions import CryptoError
from nacl.signing import SigningKey, VerifyKey
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from ..artifacts import ArtifactHandle, ArtifactLedger, owned_bytes
from ..bus import NatsBus, checked_stream_config, connect, created_bucket
from ..errors import BusConfigError, CoordinatorError, RemoteWorkerError, UsageError
from ..events import subject_token
from ..ids import U64_MAX, check_id, is_digest, is_id
from ..participant import (
    CaptureReply,
    CaptureScope,
    Participant,
    RestoreScope,
    answer_of,
    check_reply,
)
from ..wire import read_any_json, read_json
from ._companion import DEFAULT_OBJECT_TTL, remote_objects, unmap
from ._objects import DEFAULT_OBJECT_BUCKET, ObjectArtifact, ObjectBucket

__all__ = [
    "DEFAULT_LEASE_BUCKET",
    "DEFAULT_LEASE_TTL",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_RPC_PREFIX",
    "RemoteParticipant",
    "open_lease_bucket",
    "serve_participant",
]

DEFAULT_RPC_PREFIX = "ckpt-rpc"
DEFAULT_MAX_BYTES = 1 << 30  # one remote payload, declared by the other side
DEFAULT_LEASE_BUCKET = "CKPT_WORKERS"
DEFAULT_LEASE_TTL = 15.0  # seconds: how long a killed worker blocks its successor, at most

SIGNATURE_HEADER = "Ckpt-Signature"  # a reply's Ed25519 signature, hex
_SIGNED = b"coordinator.remote.reply/1"  # what the signature is of: this protocol's replies
_NO_RESPONDERS = "503"  # the server's status when no subscriber got a request
_REPLY_BYTES = 8 << 20  # replies held for checking at a time (a flood is dropped beyond it)

ScopeT = TypeVar("ScopeT", CaptureScope, RestoreScope)

Op = Literal["capture", "stage", "activate", "abort"]


class Request(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    session_id: str
    epoch: str
    checkpoint_id: str
    step: int
    object: str = ""  # capture: where to put the bytes; stage: where they are
    byte_length: int = 0  # stage: what the object must hold
    digest: str = ""
    compatibility_digest: str | None = None  # capture: the host's
    nonce: str = ""  # fresh for each request: a signed reply answers this one only

    def scope(self, kind: type[ScopeT]) -> ScopeT:
        """The worker's side of ``at``: the scope this request carries."""
        fields: dict[str, Any] = {}
        if kind is CaptureScope:
            fields["compatibility_digest"] = self.compatibility_digest
        return kind(
            session_id=self.session_id,
            epoch=self.epoch,
            checkpoint_id=self.checkpoint_id,
            step=self.step,
            **fields,
        )

    @classmethod
    def at(cls, scope: CaptureScope | RestoreScope, **fields: Any) -> Request:
        if isinstance(scope, CaptureScope):
            fields["compatibility_digest"] = scope.compatibility_digest
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
    # A capture reply says what it answers (the participant's ``CaptureReply``,
    # else the request's scope) and, if the participant states one, its
    # compatibility digest: the host checks them against what it asked.
    checkpoint_id: str = ""
    step: int = -1
    compatibility_digest: str | None = None


_REQUEST = msgspec.json.Decoder(Request)
_REPLY = msgspec.json.Decoder(Reply)


def signed_reply(subject: str, request: bytes, reply: bytes) -> bytes:
    """What a worker signs: the request it answers (``subject`` names the session,
    participant, holder and op; ``request`` is the body, with the host's nonce)
    and every byte of its ``reply``."""
    return b"\n".join((_SIGNED, subject.encode(), hashlib.sha256(request).digest(), reply))


class ReplySigner:
    """A worker's signing key, made when it starts: its public half goes into the
    lease entry, and every reply is signed with it (``signed_reply``)."""

    def __init__(self) -> None:
        self._key = SigningKey.generate()
        self.public = bytes(self._key.verify_key).hex()

    def headers(self, subject: str, request: bytes, reply: bytes) -> dict[str, str]:
        """The headers of ``reply`` to ``request`` (received on ``subject``)."""
        signature = self._key.sign(signed_reply(subject, request, reply)).signature
        return {SIGNATURE_HEADER: signature.hex()}


class _Holder(NamedTuple):
    """The lease entry's word on who serves: its id, and its reply key (hex)."""

    owner: str
    key: str


def _subject(prefix: str, session_id: str, participant: str, op: str) -> str:
    return f"{prefix}.{subject_token(session_id)}.{subject_token(participant)}.{op}"


def lease_key(session_id: str, participant: str) -> str:
    """The KV key of the lease on ``participant`` of ``session_id``."""
    return f"{subject_token(session_id)}.{subject_token(participant)}"


def capture_object(session_id: str, checkpoint_id: str, participant: str) -> str:
    return f"{session_id}/{checkpoint_id}/{participant}"  # '/' is no Id's


def stage_object(session_id: str, epoch: str, participant: str) -> str:
    return f"{session_id}/restore/{epoch}/{participant}"


def _check_max_bytes(max_bytes: int) -> int:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise UsageError(f"max_bytes must be a byte count, not {max_bytes!r}")
    return max_bytes


class RemoteParticipant:
    """A participant served by another process (``serve_participant``).

    ``timeout`` bounds each request: a worker that died mid-capture is a
    ``RemoteWorkerError`` after it (the coordinator's capture then fails and
    fences the epoch, as for any participant). Keep it below the coordinator's
    ``capture_timeout`` (30 s by default), or a dead worker surfaces as that
    deadline instead of as ``remote.timeout``.

    ``max_bytes`` (1 GiB by default) bounds what the worker may declare: a
    capture reply above it fails that participant's capture with
    ``remote.too_large`` before any memory is reserved. The writer's byte
    budget does not bound a capture that waits alone (see operations.md), so
    this is the bound on what one remote capture can make this process hold.

    Only the lease holder's signed answer is taken (see the module's notes):
    answers anyone else sends are ignored and counted (``counts()``), and a
    request that gets only those fails with ``remote.forged`` after ``timeout``.
    """

    def __init__(
        self,
        bus: NatsBus,
        name: str,
        *,
        rpc_prefix: str = DEFAULT_RPC_PREFIX,
        timeout: float = 20.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        object_bucket: str = DEFAULT_OBJECT_BUCKET,
        object_ttl: float = DEFAULT_OBJECT_TTL,
        lease_bucket: str = DEFAULT_LEASE_BUCKET,
    ) -> None:
        self.name = check_id(name)
        self.bus = bus
        self.rpc_prefix = rpc_prefix
        self.timeout = timeout
        self.max_bytes = _check_max_bytes(max_bytes)
        self.objects = remote_objects(bus, bucket=object_bucket, ttl=object_ttl)
        self.lease_bucket = lease_bucket
        self._leases: KeyValue | None = None
        self._counts = collections.Counter[str]()

    async def capture_artifact(self, scope: CaptureScope, ledger: ArtifactLedger) -> ArtifactHandle:
        """The worker's capture, as a handle on the object it put in the bucket."""
        object_name = capture_object(scope.session_id, scope.checkpoint_id, self.name)
        request = Request.at(scope, object=object_name)
        try:
            bucket = await self.objects.bucket()
            reply = await self._request("capture", request)
            check_reply(
                self.name, scope, reply.checkpoint_id, reply.step, reply.compatibility_digest
            )
            if reply.byte_length > self.max_bytes:  # before anything is reserved for it
                raise RemoteWorkerError(
                    self.name,
                    "remote.too_large",
                    f"the worker declared {reply.byte_length} bytes, more than this "
                    f"participant's limit of {self.max_bytes} (max_bytes=)",
                )
        except BaseException:
            # A late worker may still finish its put: delete what it may leave
            # (the bucket's TTL takes what is put after this).
            self.objects.delete_soon(object_name)
            raise
        return ObjectArtifact(
            self.name,
            reply.byte_length,
            reply.digest,
            ledger,
            bucket=bucket,
            object_name=object_name,
            on_release=self.objects.delete_soon,
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
        bucket = await self.objects.bucket()
        object_name = stage_object(scope.session_id, scope.epoch, self.name)
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
            self.objects.delete_soon(object_name)
        return request

    async def activate_restore(self, token: Request) -> None:
        await self._request("activate", token)

    async def abort_restore(self, token: Request) -> None:
        await self._request("abort", token)

    def counts(self) -> dict[str, int]:
        """replies_forged: answers not signed by the lease holder, ignored."""
        return dict(self._counts)

    async def _holder(self, session_id: str) -> _Holder:
        """The worker holding the lease now and its reply key (``remote.no_worker``
        if none; ``remote.unsigned`` if its entry names no key: an older worker)."""
        key = lease_key(session_id, self.name)
        try:
            if self._leases is None:
                self._leases = await self.bus.client.jetstream().key_value(self.lease_bucket)
            entry = await self._leases.get(key)
            lease = read_any_json(entry.value or b"{}")
            holder, public = lease.get("owner"), lease.get("key")
        except (BucketNotFoundError, KeyNotFoundError, msgspec.MsgspecError, AttributeError):
            holder = public = None
        if not isinstance(holder, str) or not holder.isalnum():
            raise RemoteWorkerError(
                self.name, "remote.no_worker", f"no worker holds the lease {key}"
            )
        if not (isinstance(public, str) and is_digest(public)):
            raise RemoteWorkerError(
                self.name,
                "remote.unsigned",
                f"the worker holding the lease {key} publishes no reply key (a worker "
                "older than this host?): its answers could not be told from anyone "
                "else's; upgrade it",
            )
        return _Holder(holder, public)

    async def _request(self, op: Op, request: Request) -> Reply:
        """Ask the worker that holds the lease (on its own subject: a worker that
        lost it, even one frozen and still connected, is never asked), take the
        first answer it signed (any other is counted and ignored: whoever can
        subscribe can answer), and accept it only if it still holds the lease
        after answering."""
        holder = await self._holder(request.session_id)
        subject = _subject(self.rpc_prefix, request.session_id, self.name, f"{holder.owner}.{op}")
        data = msgspec.json.encode(msgspec.structs.replace(request, nonce=os.urandom(16).hex()))
        answers = _Answers(self.name, VerifyKey(bytes.fromhex(holder.key)), subject, data)
        client = self.bus.client
        # An inbox of our own, not ``request``: that takes the first answer, whoever's.
        inbox = await client.subscribe(
            client.new_inbox(), cb=answers.take, pending_bytes_limit=_REPLY_BYTES
        )
        try:
            await client.publish(subject, data, reply=inbox.subject)
            with anyio.move_on_after(self.timeout):
                await answers.done.wait()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await inbox.unsubscribe()
            self._counts["replies_forged"] += answers.forged
        reply = answers.result(op, self.timeout)
        if not reply.ok:
            raise RemoteWorkerError(self.name, reply.code, reply.reason)
        if await self._holder(request.session_id) != holder:
            raise RemoteWorkerError(
                self.name, "remote.lease_lost", f"the worker that answered {op} lost its lease"
            )
        if op == "capture" and (reply.byte_length < 0 or not is_digest(reply.digest)):
            raise RemoteWorkerError(self.name, "remote.protocol", f"a bad capture reply {reply}")
        return reply


class _Answers:
    """The answers to one request: the first one the holder signed, and how many
    others came (forged). A "no responders" status is noted, not believed: its
    headers are anyone's to write, and the holder may still answer."""

    def __init__(self, participant: str, key: VerifyKey, subject: str, request: bytes) -> None:
        self.participant = participant
        self.key = key
        self.subject = subject
        self.request = request
        self.done = anyio.Event()
        self.reply: Reply | None = None
        self.error: RemoteWorkerError | None = None
        self.forged = 0
        self.no_responders = False

    async def take(self, message: Msg) -> None:
        if self.done.is_set():
            return
        headers = message.headers or {}
        if headers.get("Status") == _NO_RESPONDERS and not message.data:
            self.no_responders = True
            return
        try:
            signature = bytes.fromhex(headers.get(SIGNATURE_HEADER, ""))
            self.key.verify(signed_reply(self.subject, self.request, message.data), signature)
        except (ValueError, CryptoError):
            self.forged += 1
            return
        try:  # the holder's own word from here: a bad one is its protocol error
            self.reply = read_json(message.data, _REPLY)
        except msgspec.MsgspecError as error:
            self.error = RemoteWorkerError(self.participant, "remote.protocol", str(error))
        self.done.set()

    def result(self, op: str, timeout: float) -> Reply:
        """The holder's reply, or why there is none."""
        if self.reply is not None:
            return self.reply
        if self.error is not None:
            raise self.error
        if self.forged:
            raise RemoteWorkerError(
                self.participant,
                "remote.forged",
                f"{self.forged} answer(s) to {op} not signed by the worker holding the "
                f"lease (someone else subscribes to {self.subject}), and none from it "
                f"within {timeout} s",
            )
        if self.no_responders:
            raise RemoteWorkerError(
                self.participant, "remote.no_worker", f"no worker serves {self.subject}"
            )
        raise RemoteWorkerError(
            self.participant,
            "remote.timeout",
            f"no answer to {op} within {timeout} s (the worker may have died)",
        )


async def serve_participant(
    servers: str | Sequence[str],
    participant: Participant,
    *,
    session_id: str,
    rpc_prefix: str = DEFAULT_RPC_PREFIX,
    object_bucket: str = DEFAULT_OBJECT_BUCKET,
    object_ttl: float = DEFAULT_OBJECT_TTL,
    replicas: int = 1,
    connect_timeout: float = 5.0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    lease_bucket: str = DEFAULT_LEASE_BUCKET,
    lease_ttl: float = DEFAULT_LEASE_TTL,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    **connect_options: Any,
) -> None:
    """Serve ``participant`` (the ``Participant`` protocol) for one session until
    cancelled. Requests are answered one at a time, in order.

    The worker first takes the participant's lease (``RemoteWorkerError``
    ``remote.duplicate`` if another worker holds it) and keeps it while it
    serves; losing it ends the call with ``remote.lease_lost``. The lease
    bucket is created with ``lease_ttl``; an existing one's own TTL is used.
    ``max_bytes`` bounds the payload a stage request may name
    (``remote.too_large`` beyond it, before anything is read)."""
    check_id(session_id)
    check_id(participant.name)
    _check_max_bytes(max_bytes)
    if not lease_ttl > 0:
        raise UsageError(f"lease_ttl must be positive, not {lease_ttl!r}")
    client = await connect(
        [servers] if isinstance(servers, str) else servers,
        connect_timeout,
        error_cb=_ignore,
        **connect_options,
    )
    try:
        js = client.jetstream()
        bucket = await ObjectBucket.open(js, object_bucket, ttl=object_ttl, replicas=replicas)
        leases, ttl = await open_lease_bucket(js, lease_bucket, ttl=lease_ttl, replicas=replicas)
        ping = _subject(rpc_prefix, session_id, participant.name, "ping")
        key = lease_key(session_id, participant.name)
        signer = ReplySigner()  # this run's own: a restarted worker has a new one
        lease = await _Lease.acquire(
            client, leases, key, participant=participant.name, ttl=ttl, ping=ping,
            public_key=signer.public,
        )  # fmt: skip
        subscriptions = []
        try:
            worker = _Worker(
                participant, bucket, session_id=session_id, max_bytes=max_bytes, lease=lease,
                client=client, signer=signer,
            )  # fmt: skip
            # Pings on a subscription of their own: answered while a capture runs.
            subscriptions.append(await client.subscribe(ping, cb=worker.pong))
            # Requests on the holder's own subject: a worker that lost the lease
            # (frozen, its connection still up) is never sent one.
            subscriptions.append(
                await client.subscribe(
                    _subject(rpc_prefix, session_id, participant.name, f"{lease.owner_id}.*"),
                    cb=worker.answer,
                )
            )
            await client.flush()
            task_status.started()
            await lease.keep()
        finally:
            with anyio.CancelScope(shield=True):
                for subscription in subscriptions:  # answer nothing more, then let go
                    with contextlib.suppress(Exception):
                        await subscription.unsubscribe()
                await lease.release()
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await client.close()


async def open_lease_bucket(
    js: JetStreamContext, name: str, *, ttl: float, replicas: int
) -> tuple[KeyValue, float]:
    """The workers' lease bucket (created with ``ttl`` if it is missing, checked
    otherwise) and its TTL, which is the lease's."""
    try:
        leases = await js.key_value(name)
    except BucketNotFoundError:
        # (another worker may have made it first, maybe with another TTL)
        leases = await created_bucket(js, name, ttl=ttl, history=1, replicas=replicas)
    max_age = (await checked_stream_config(js, f"KV_{name}")).max_age
    if not max_age:
        raise BusConfigError(
            f"lease bucket {name} has no TTL: a killed worker's lease would never expire; "
            "create it with one (lease_ttl=...), it is left as it is"
        )
    return leases, max_age


class _Lease:
    """The worker's hold on its participant: one KV key, taken with ``create``,
    refreshed with ``update(last=revision)``, expired by the bucket's TTL. The
    holder counts the lease from the moment it *sent* its last successful
    refresh, so it believes itself the holder no longer than the server does."""

    def __init__(
        self, kv: KeyValue, key: str, *, participant: str, owner: bytes, ttl: float
    ) -> None:
        self.kv = kv
        self.key = key
        self.participant = participant
        self.owner = owner  # this worker's value: unique, so a refresh that landed is known
        self.ttl = ttl
        self.revision = 0
        self.renewed_at = -float("inf")

    def held(self) -> bool:
        return time.monotonic() < self.renewed_at + self.ttl

    @property
    def owner_id(self) -> str:
        """This worker's id in the lease: hosts send requests to it."""
        return str(read_any_json(self.owner)["owner"])

    @classmethod
    async def acquire(
        cls,
        client: Client,
        kv: KeyValue,
        key: str,
        *,
        participant: str,
        ttl: float,
        ping: str,
        public_key: str,
    ) -> _Lease:
        """Take the key, or raise ``remote.duplicate``: at once if its holder answers
        a ping, or refreshes the key while we wait; else the key expires within a
        TTL (a killed holder) and is taken then. The entry names this worker and
        the key its replies are signed with (``public_key``)."""
        owner = msgspec.json.encode(
            {
                "owner": os.urandom(8).hex(),
                "key": public_key,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
        )
        lease = cls(kv, key, participant=participant, owner=owner, ttl=ttl)
        deadline = time.monotonic() + ttl * 4 / 3
        seen: int | None = None
        while True:
            sent = time.monotonic()
            try:
                revision = await kv.create(key, owner)
            except (KeyWrongLastSequenceError, KeyNotFoundError, KeyDeletedError):
                pass  # held (or let go this very moment: nats-py's create reads it back)
            else:
                lease.revision, lease.renewed_at = revision, sent
                return lease
            try:
                entry = await kv.get(key)
            except (KeyNotFoundError, KeyDeletedError):  # gone meanwhile: try again
                entry = None
            if entry is not None:
                if seen is None:
                    seen = entry.revision
                    if await _answers(client, ping, timeout=min(1.0, ttl / 3)):
                        raise _duplicate(participant, f"a live worker answers {ping}")
                elif entry.revision != seen:
                    raise _duplicate(participant, "its lease was refreshed while we waited")
            if time.monotonic() >= deadline:
                raise _duplicate(participant, f"its lease {key} did not expire within {ttl} s")
            await anyio.sleep(min(0.5, ttl / 10))

    async def keep(self) -> NoReturn:
        """Refresh every third of the TTL until cancelled; ``remote.lease_lost``
        when the key is someone else's, or could not be refreshed within the TTL."""
        interval = self.ttl / 3
        while True:
            await anyio.sleep(max(0.0, self.renewed_at + interval - time.monotonic()))
            sent = time.monotonic()
            try:
                with anyio.fail_after(max(0.01, self.renewed_at + self.ttl - sent)):
                    revision = await self.kv.update(self.key, self.owner, last=self.revision)
            except KeyWrongLastSequenceError:
                if not await self._still_ours():
                    raise self.lost("another worker holds it, or it expired") from None
                continue
            except (nats.errors.Error, TimeoutError):
                if not self.held():
                    raise self.lost(f"it could not be refreshed within {self.ttl} s") from None
                await anyio.sleep(min(0.25, interval / 4))
                continue
            self.revision, self.renewed_at = revision, sent

    async def _still_ours(self) -> bool:
        """After a refused refresh: an earlier one that timed out on our side may
        have landed. Then the key still holds our owner, and its revision is ours."""
        try:
            with anyio.fail_after(max(0.01, self.renewed_at + self.ttl - time.monotonic())):
                entry = await self.kv.get(self.key)
        except (nats.errors.Error, TimeoutError):
            return False
        if entry.value != self.owner or entry.revision is None:
            return False
        self.revision = entry.revision
        return True

    def lost(self, reason: str) -> RemoteWorkerError:
        return RemoteWorkerError(
            self.participant, "remote.lease_lost", f"this worker lost its lease: {reason}"
        )

    async def release(self) -> None:
        """Delete the key if it is still ours (bounded, best effort: the TTL expires
        it otherwise), so a successor starts at once."""
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(5),
            contextlib.suppress(Exception),
        ):
            await self.kv.delete(self.key, last=self.revision)


def _duplicate(participant: str, reason: str) -> RemoteWorkerError:
    return RemoteWorkerError(
        participant, "remote.duplicate", f"another worker already serves it ({reason})"
    )


async def _answers(client: Client, subject: str, *, timeout: float) -> bool:
    try:
        await client.request(subject, b"", timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
        return False
    return True


def _decode_request(data: bytes) -> Request:
    try:
        return read_json(data, _REQUEST)
    except msgspec.MsgspecError as error:
        raise RemoteWorkerError("?", "remote.protocol", f"a bad request: {error}") from None


async def _ignore(error: Exception) -> None:
    """The worker's connection errors: it reconnects; requests time out meanwhile."""


class _Worker:
    def __init__(
        self,
        participant: Participant,
        bucket: ObjectBucket,
        *,
        session_id: str,
        max_bytes: int,
        lease: _Lease,
        client: Client,
        signer: ReplySigner,
    ) -> None:
        self.participant = participant
        self.bucket = bucket
        self.session_id = session_id
        self.max_bytes = max_bytes
        self.lease = lease
        self.client = client
        self.signer = signer
        self.staged: dict[tuple[str, str], Any] = {}  # (epoch, checkpoint) -> token

    async def pong(self, message: Msg) -> None:
        """Another worker asks whether this participant is served: it is, while
        the lease is ours (a busy capture does not delay this answer)."""
        if self.lease.held():
            with contextlib.suppress(Exception):
                await message.respond(msgspec.json.encode(Reply(ok=True)))

    async def answer(self, message: Msg) -> None:
        op = message.subject.rsplit(".", 1)[-1]
        if op == "ping":  # answered by ``pong``; the wildcard brings it here too
            return
        try:
            if not self.lease.held():
                raise self.lease.lost("it expired before this request")
            request = _decode_request(message.data)
            self._check(op, request)
            reply = await self._do(op, request)
            if reply.ok and not self.lease.held():  # (paused, say) another may serve now
                raise self.lease.lost("it expired while this request ran")
        except RemoteWorkerError as error:
            reply = Reply(ok=False, code=error.remote_code, reason=error.reason)
        except CoordinatorError as error:
            reply = Reply(ok=False, code=error.code, reason=str(error))
        except Exception as error:  # the participant's own failure, reported as is
            reply = Reply(ok=False, code="remote.failed", reason=repr(error))
        if not message.reply:
            return
        data = msgspec.json.encode(reply)
        headers = self.signer.headers(message.subject, message.data, data)
        with contextlib.suppress(Exception):  # the requester gave up, or the bus is away
            await self.client.publish(message.reply, data, headers=headers)

    def _check(self, op: str, request: Request) -> None:
        """A request must be for the served session, with valid ids, and name the
        one object its op may touch: the worker never reads or writes another."""
        name = self.participant.name

        def bad(reason: str) -> NoReturn:
            raise RemoteWorkerError(name, "remote.bad_request", f"{op}: {reason}")

        if request.session_id != self.session_id:
            bad(f"session {request.session_id!r}, not {self.session_id!r}")
        if not (is_id(request.epoch) and is_id(request.checkpoint_id)):
            bad(f"epoch {request.epoch!r} or checkpoint {request.checkpoint_id!r} is no Id")
        if not 0 <= request.step <= U64_MAX:
            bad(f"step {request.step} is no U64")
        if op not in ("capture", "stage"):
            return  # activate and abort name no object: their key must have been staged
        if op == "capture":
            expected = capture_object(self.session_id, request.checkpoint_id, name)
        else:
            expected = stage_object(self.session_id, request.epoch, name)
        if request.object != expected:
            bad(f"object {request.object!r}, not {expected!r}")
        if op == "stage":
            if not is_digest(request.digest):
                bad(f"digest {request.digest!r} is no SHA-256")
            if request.byte_length < 0:
                bad(f"byte length {request.byte_length}")
            if request.byte_length > self.max_bytes:  # before anything is read
                raise RemoteWorkerError(
                    name,
                    "remote.too_large",
                    f"stage of {request.byte_length} bytes, more than this worker's "
                    f"limit of {self.max_bytes} (max_bytes=)",
                )

    async def _do(self, op: str, request: Request) -> Reply:
        key = (request.epoch, request.checkpoint_id)
        if op == "capture":
            answer = await answer_of(self.participant, request.scope(CaptureScope))
            if not isinstance(answer, CaptureReply):  # it answers the scope it was handed
                answer = CaptureReply(
                    data=answer, checkpoint_id=request.checkpoint_id, step=request.step
                )
            data = await owned_bytes(answer.data)
            if not self.lease.held():  # nothing put for a request another worker owns now
                raise self.lease.lost("it expired while the participant captured")
            with memoryview(data) as view:
                flat = view.cast("B") if view.format != "B" else view
                digest = await self.bucket.put(request.object, flat)
                return Reply(
                    ok=True,
                    byte_length=flat.nbytes,
                    digest=digest,
                    checkpoint_id=answer.checkpoint_id,
                    step=answer.step,
                    compatibility_digest=answer.compatibility_digest,
                )
        if op == "stage":
            restore = request.scope(RestoreScope)
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

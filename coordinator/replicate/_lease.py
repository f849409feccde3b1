"""One owner per session across machines: a lease in the KV bucket ``CKPT_LEASES``.

A host that opens a session takes its lease with a revision-checked create (key:
the session's token), renews it on a heartbeat (a revision-checked update), and
gives it up when it leaves. A second host is refused (``SessionLeasedError``,
code ``session.leased``) until the lease has not been renewed for its TTL, or it
takes the session over explicitly (``take_over=True``): either way its write
bumps the revision, and the first holder's next renewal fails, so it knows it
lost the session (``LeaseLostError``, code ``session.lease_lost``). A holder that
could not renew for most of the TTL (cut off, or paused) may have lost it without
knowing: until a renewal lands again its lease counts as expired
(``LeaseExpiredError``, code ``session.lease_expired``).

The lease revision is the fence of the replicated tier: every pointer update
records the lease revision it was made under, a new owner stamps the pointer
with its own at once, and an update under an older revision is refused. Expiry
compares the holder's renewal time with the contender's clock: keep clocks
within a small part of the TTL.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import socket
import time
from typing import Any, Self

import anyio
import msgspec
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)

from ..bus import NatsBus, checked_stream_config, created_bucket
from ..errors import (
    LeaseExpiredError,
    LeaseLostError,
    SessionLeasedError,
    UsageError,
    check_seconds,
)
from ..events import subject_token
from ..ids import check_id
from ..wire import read_json
from ._unavailable import cluster_errors

_log = logging.getLogger("coordinator.replicate")

__all__ = ["LEASES_BUCKET", "SessionLease"]

LEASES_BUCKET = "CKPT_LEASES"
MAX_TTL_S = 24 * 3600.0
# A holder stops counting on its lease this far into the TTL after its last renewal
# landed (dated before it was sent): a contender whose clock is ahead by less than
# the rest of the TTL cannot take it while the holder still steps.
HELD_FOR = 0.9
_ACQUIRE_ATTEMPTS = 5


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    holder: str  # who, for people (the caller may choose it: not unique)
    ttl_s: float
    renewed_at: float  # the holder's wall clock, seconds since the epoch
    instance: str = ""  # this lease object's own random token: what "ours" means


_LEASE = msgspec.json.Decoder(LeaseRecord)


def _held(value: bytes | None) -> LeaseRecord | None:
    """The lease a KV value records, or ``None`` for one no holder could have
    written (malformed, a TTL that is not a positive finite number, a renewal
    from the future): it can be taken like an expired one."""
    try:
        held = read_json(value or b"", _LEASE)
    except msgspec.MsgspecError:
        return None
    sane = math.isfinite(held.ttl_s) and 0 < held.ttl_s <= MAX_TTL_S
    if not (sane and math.isfinite(held.renewed_at) and held.renewed_at <= time.time() + 60):
        return None
    return held


class SessionLease:
    """``async with SessionLease(bus, "s1") as lease:`` holds session ``s1`` while
    the block runs (renewed every ``ttl / 3`` seconds). ``lease.revision`` is the
    fence; ``await lease.check()`` raises ``LeaseLostError`` once it was taken,
    and ``lease.lost`` holds it once a renewal found it taken (it is logged too),
    or a ``LeaseExpiredError`` while no renewal landed for ``HELD_FOR`` of the TTL
    (the cluster unreachable, the host paused): nothing stops the host's block, so
    a host checks before each step (``Coordinator(lease=)`` does)."""

    def __init__(
        self,
        bus: NatsBus,
        session_id: str,
        *,
        ttl: float = 15.0,
        take_over: bool = False,
        holder: str | None = None,
    ) -> None:
        ttl = check_seconds(ttl, "a lease's ttl", most=MAX_TTL_S)
        self.bus = bus
        self.session_id = check_id(session_id)
        self.ttl = ttl
        self.take_over = take_over
        self.holder = holder or f"{socket.gethostname()}:{secrets.token_hex(4)}"
        self.instance = secrets.token_hex(16)  # never the caller's choice: unique
        self.revision = 0
        self._lost: LeaseLostError | None = None  # taken: for good
        self._dated = 0.0  # (monotonic) when the value written last was dated
        self._held_until = math.inf  # (monotonic) until a contender may take it
        self._expiry_told = False
        self._holding = False  # (between the block's start and its end)
        self._kv: Any = None
        self._group: Any = None
        self._writing = anyio.Lock()  # a renewal and a check never interleave

    @property
    def key(self) -> str:
        return subject_token(self.session_id)

    @property
    def lost(self) -> LeaseLostError | UsageError | None:
        """``LeaseLostError`` once a renewal found the lease taken; a
        ``LeaseExpiredError`` while no renewal landed for ``HELD_FOR`` of the TTL
        (until one lands again); else ``None``."""
        if self._lost is None and not self._holding:
            return self._not_held()
        if self._lost is None and time.monotonic() >= self._held_until:
            return self._expired()
        return self._lost

    def _not_held(self) -> UsageError:
        when = "no longer" if self.revision else "not yet"
        return UsageError(
            f"the lease of session {self.session_id} is {when} held: a Coordinator given "
            "it (lease=) runs inside the lease's block (async with SessionLease(...) as "
            "lease, then the Coordinator), so its close comes before the lease's"
        )

    def _expired(self) -> LeaseExpiredError:
        since = time.monotonic() - self._held_until + self.ttl * HELD_FOR
        return LeaseExpiredError(
            f"the lease of session {self.session_id} was last renewed {since:.1f} s ago "
            f"(its TTL is {self.ttl:g} s; the cluster did not answer, or this host was "
            f"paused): another host may own the session now. {self.holder} takes no step "
            "of it until a renewal finds the lease still its own"
        )

    def _landed(self, revision: int) -> None:
        """A write of the value dated last landed: held again from that date."""
        self.revision = revision
        self._held_until = self._dated + self.ttl * HELD_FOR
        if self._expiry_told:
            self._expiry_told = False
            _log.warning("the lease of session %s is %s's again", self.session_id, self.holder)

    def _value(self) -> bytes:
        self._dated = time.monotonic()
        return msgspec.json.encode(
            LeaseRecord(
                holder=self.holder, ttl_s=self.ttl, renewed_at=time.time(),
                instance=self.instance,
            )
        )  # fmt: skip

    async def __aenter__(self) -> Self:
        js = self.bus.client.jetstream()
        with cluster_errors(f"the lease of session {self.session_id}"):
            try:
                self._kv = await js.key_value(LEASES_BUCKET)
            except BucketNotFoundError:
                self._kv = await created_bucket(
                    js, LEASES_BUCKET, history=1, replicas=self.bus.replicas
                )
            await checked_stream_config(js, f"KV_{LEASES_BUCKET}")
            await self._acquire()
        self._holding = True
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._renew)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._holding = False
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)
        if self._lost is None:  # still ours: let the next host in at once
            # (taken meanwhile, or the bus is gone: then it expires on its own)
            with contextlib.suppress(Exception):
                try:
                    await self._kv.delete(self.key, last=self.revision)
                except BadRequestError:  # (the revision moved: a renewal whose ack was lost?)
                    if await self._still_ours():
                        await self._kv.delete(self.key, last=self.revision)

    async def _acquire(self) -> None:
        for _ in range(_ACQUIRE_ATTEMPTS):
            try:
                self._landed(int(await self._kv.create(self.key, self._value())))
                return
            except (KeyWrongLastSequenceError, KeyNotFoundError, KeyDeletedError):
                pass  # held, or held once (its holder may be letting it go this moment)
            try:
                entry = await self._kv.get(self.key)
            except (KeyNotFoundError, KeyDeletedError):
                continue  # let go meanwhile: create it again
            await self._take(entry)
            return
        raise SessionLeasedError(
            f"session {self.session_id}: the lease kept changing under {_ACQUIRE_ATTEMPTS} "
            "attempts to take it"
        )

    async def _take(self, entry: Any) -> None:
        """Take the lease ``entry`` holds, if it expired (or we take it over)."""
        held = _held(entry.value)
        expired = held is None or time.time() - held.renewed_at > held.ttl_s
        if not (expired or self.take_over):
            assert held is not None
            left = held.ttl_s - (time.time() - held.renewed_at)
            raise SessionLeasedError(
                f"session {self.session_id} is held by {held.holder}, renewed "
                f"{time.time() - held.renewed_at:.1f} s ago: a live holder renews it every "
                f"{held.ttl_s / 3:.1f} s; a holder that is gone (this host, restarted "
                f"after a crash?) lets it expire in {left:.1f} s. Wait for that, or take "
                "it over explicitly (take_over=True) once the holder is known to be gone"
            )
        try:
            self._landed(
                int(await self._kv.update(self.key, self._value(), last=int(entry.revision)))
            )
        except KeyWrongLastSequenceError:
            raise SessionLeasedError(
                f"session {self.session_id}: another host took the lease at the same moment"
            ) from None

    async def _renew(self) -> None:
        while True:
            # A third of the TTL after the last one was sent, not after its answer
            # (helper-74: with the round trip added to each beat, a lease the server
            # held all along expired here once the round trip passed 0.28 TTL).
            await anyio.sleep(max(0.0, self._dated + self.ttl / 3 - time.monotonic()))
            try:
                async with self._writing:
                    self._landed(
                        int(await self._kv.update(self.key, self._value(), last=self.revision))
                    )
            except KeyWrongLastSequenceError:
                try:
                    ours = await self._still_ours()
                except Exception:  # cannot tell now: the next beat asks again
                    self._tell_expiry()
                    continue
                if not ours:
                    self._lost = LeaseLostError(
                        f"the lease of session {self.session_id} was taken over: "
                        f"{self.holder} no longer owns it"
                    )
                    _log.warning("%s; stop this host's steps of the session", self._lost)
                    return
            except Exception:  # the bus is away: try again at the next beat
                self._tell_expiry()
                continue

    def _tell_expiry(self) -> None:
        expired = self.lost
        if isinstance(expired, LeaseExpiredError) and not self._expiry_told:
            self._expiry_told = True
            _log.warning("%s", expired)

    async def _still_ours(self) -> bool:
        """Whether the lease's value is still this holder's: a renewal the server
        applied but whose ack was lost moved the revision under us (then we adopt
        it). Each lease object writes a random token of its own (``instance``),
        so a value carrying ours is ours, whatever the holder names."""
        async with self._writing:
            try:
                entry = await self._kv.get(self.key)
            except (KeyNotFoundError, KeyDeletedError):
                return False
            held = _held(entry.value)
            if held is None or held.instance != self.instance:
                return False
            # (dated by our own wall clock: how long ago, on the monotonic one)
            self._dated = time.monotonic() - max(0.0, time.time() - held.renewed_at)
            self._landed(int(entry.revision))
            return True

    async def check(self) -> None:
        """``LeaseLostError`` unless the lease is still this holder's;
        ``LeaseExpiredError`` while no renewal landed for ``HELD_FOR`` of the TTL
        (the cluster may say it is still ours: a contender may take it any moment),
        or once it expires while the cluster does not answer;
        ``BusUnavailableError`` if the cluster cannot tell now."""
        if (lost := self.lost) is not None and not isinstance(lost, LeaseExpiredError):
            raise lost  # (taken, or not held)
        # No longer than the lease holds (helper-74: a check on a dead link waited
        # 5-15 s, a resume with it, while a contender could take the lease).
        with (
            cluster_errors(f"the lease of session {self.session_id}"),
            anyio.move_on_after(max(0.0, self._held_until - time.monotonic())),
        ):
            await self._check()
        if (expired := self.lost) is not None:
            raise expired

    async def _check(self) -> None:
        async with self._writing:  # (a renewal's new revision is known once it is read)
            try:
                entry = await self._kv.get(self.key)
            except (KeyNotFoundError, KeyDeletedError):
                entry = None
            held = entry is not None and int(entry.revision) == self.revision
        if not held and not (entry is not None and await self._still_ours()):
            self._lost = LeaseLostError(
                f"the lease of session {self.session_id} is no longer {self.holder}'s"
            )
            raise self._lost

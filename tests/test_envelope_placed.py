"""Planning an envelope before its payload digests are known (issue 29, part 3):
the layout never depends on a digest, so every payload can be written at its
offset while the digests are computed on several threads; only the prefix
(which holds them) and the footer wait."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import pytest
from conftest import minimal_manifest

from coordinator import EnvelopeInputError, envelope

PLACEHOLDER = "0" * 64


def payloads_of(sizes: list[int]) -> list[tuple[str, bytes]]:
    return [(f"part-{index}", os.urandom(size)) for index, size in enumerate(sizes)]


def pending_manifest(payloads: list[tuple[str, bytes]], pending: set[str]) -> dict[str, Any]:
    """The manifest of ``payloads`` with a placeholder for each pending digest."""
    manifest = minimal_manifest(payloads)
    manifest["payloads"] = [
        {**record, "digest": PLACEHOLDER} if record["name"] in pending else record
        for record in manifest["payloads"]
    ]
    return manifest


def assembled(plan: envelope.EnvelopePlan, footer: bytes) -> bytes:
    """The file a writer makes from placed pieces: each at its offset, then the
    prefix at 0 and the footer at the end (the order does not matter)."""
    out = bytearray(plan.size)
    for offset, piece in plan.placed():
        out[offset : offset + len(piece)] = piece
    out[: len(plan.prefix)] = plan.prefix
    out[plan.layout.footer_offset :] = footer
    return bytes(out)


# Three payloads of odd lengths (padding between them), one over the threshold
# above which digests run on several threads.
SIZES = [3 << 20, 1001, (1 << 20) + 5]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_pending_digests_give_the_same_envelope_as_known_ones(threads: int) -> None:
    """A plan whose digests are pending lays out exactly as the finished one (the
    placed pieces are final from the start), and once digested its prefix and
    footer are byte for byte those of the envelope encoded with the true digests."""
    payloads = payloads_of(SIZES)
    names = {name for name, _ in payloads}
    expected = envelope.encode(minimal_manifest(payloads), payloads)
    plan = envelope.plan(pending_manifest(payloads, names), payloads, digests_pending=names)
    before = [(offset, bytes(piece)) for offset, piece in plan.placed()]
    assert not plan.digested
    digests = plan.digest(threads)
    assert plan.digested
    assert digests == tuple(hashlib.sha256(data).hexdigest() for _, data in payloads)
    assert [(offset, bytes(piece)) for offset, piece in plan.placed()] == before
    sealed = plan.seal(threads=threads)
    assert sealed.payload_digests == digests
    data = assembled(plan, sealed.footer)
    assert data == expected
    assert sealed.envelope_digest == hashlib.sha256(expected).hexdigest()
    decoded = envelope.decode(data)
    assert [r["digest"] for r in decoded.manifest["payloads"]] == list(digests)


def test_some_pending_some_claimed() -> None:
    """Only the named payloads are computed; the others' claims are proven, and a
    wrong claim is refused even while others are pending."""
    payloads = payloads_of(SIZES)
    plan = envelope.plan(
        pending_manifest(payloads, {"part-1"}), payloads, digests_pending={"part-1"}
    )
    plan.digest(2)
    assert plan.seal().footer == envelope.encode(minimal_manifest(payloads), payloads)[-48:]
    wrong = pending_manifest(payloads, {"part-1"})
    wrong["payloads"][0] = {**wrong["payloads"][0], "digest": "ab" * 32}
    claimed = envelope.plan(wrong, payloads, digests_pending={"part-1"})
    with pytest.raises(EnvelopeInputError, match=r"part-0.*does not match"):
        claimed.digest(2)
    assert not claimed.digested


def test_trusted_claims_are_not_hashed_again() -> None:
    """With payloads_verified nothing is hashed for the payloads: their digests
    are known at once (the footer pass is the only one)."""
    payloads = payloads_of([2 << 20, 2 << 20])
    manifest = minimal_manifest(payloads)
    plan = envelope.plan(manifest, payloads, payloads_verified=True)
    assert plan.digested
    assert plan.digest(4) == tuple(r["digest"] for r in manifest["payloads"])


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_changed_payload_is_refused_on_any_number_of_threads(threads: int) -> None:
    payloads = payloads_of([2 << 20, 2 << 20, 2 << 20])
    manifest = minimal_manifest(payloads)
    flipped = bytes([payloads[2][1][0] ^ 1])  # (a fixed byte could be the random one)
    changed = [*payloads[:2], ("part-2", flipped + payloads[2][1][1:])]
    with pytest.raises(EnvelopeInputError, match="part-2"):
        envelope.plan(manifest, changed).digest(threads)
    with pytest.raises(EnvelopeInputError, match="part-2"):
        envelope.plan(manifest, changed).seal(threads=threads)


def test_stream_of_a_pending_plan_is_the_envelope() -> None:
    """stream() computes pending digests first (the prefix holds them), then
    streams the envelope encode() makes with the true digests."""
    payloads = payloads_of(SIZES)
    names = {name for name, _ in payloads}
    plan = envelope.plan(pending_manifest(payloads, names), payloads, digests_pending=names)
    data = b"".join(bytes(piece) for piece in plan.stream(threads=2))
    assert data == envelope.encode(minimal_manifest(payloads), payloads)
    assert plan.sealed is not None
    assert plan.sealed.envelope_digest == hashlib.sha256(data).hexdigest()


def test_digests_split_across_threads() -> None:
    """Each payload is hashed once, on one of ``threads`` threads (the caller's
    among them), and ``thread_setup`` runs on every other one first."""
    payloads = payloads_of([4 << 20, 1 << 20, 1 << 20, 2 << 20])
    names = {name for name, _ in payloads}
    plan = envelope.plan(pending_manifest(payloads, names), payloads, digests_pending=names)
    setups: list[str] = []
    plan.digest(3, thread_setup=lambda: setups.append(threading.current_thread().name))
    assert 1 <= len(setups) <= 2 and all(name.startswith("flysess-digest") for name in setups)
    assert plan.digest(3) == tuple(hashlib.sha256(d).hexdigest() for _, d in payloads)


def test_pending_names_are_checked() -> None:
    payloads = payloads_of([10, 20])
    manifest = pending_manifest(payloads, {"part-0"})
    with pytest.raises(EnvelopeInputError, match="not given"):
        envelope.plan(manifest, payloads, digests_pending={"part-9"})
    with pytest.raises(EnvelopeInputError, match="collection"):
        envelope.plan(manifest, payloads, digests_pending="part-0")


def test_placed_covers_everything_between_prefix_and_footer() -> None:
    """placed() is contiguous from the end of the prefix to the footer: payloads
    and their zero padding, in file order."""
    payloads = payloads_of([5, 0, 13, 8])
    plan = envelope.plan(minimal_manifest(payloads), payloads)
    at = len(plan.prefix)
    for offset, piece in plan.placed():
        assert offset == at
        at += len(piece)
    assert at == plan.layout.footer_offset

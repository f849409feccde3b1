"""Restore in one read: each payload goes straight into the memory its
participant provides (``restore_buffer``), is verified there, and only then is
staged. A bit flipped anywhere is refused before any participant sees a byte."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import random
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostkit import NAMES, Part, RecordingBus, cancelled_soon, describe

from coordinator import GenerationCorruptError, RestoreFailedError, WriterClosedError
from coordinator.envelope import FOOTER_BYTES, HEADER_BYTES
from coordinator.events import Committed
from coordinator.session import Coordinator, RestoreScope
from coordinator.store import FileStore

BIG = 3 << 20  # above the threaded read's threshold


class InPlace(Part):
    """A participant that restores into an array it provides and adopts."""

    def __init__(self, name: str, size: int = 0) -> None:
        super().__init__(name)
        if size:
            self.state = os.urandom(size)
        self.buffers: list[np.ndarray[Any, Any]] = []
        self.asked: list[tuple[int, RestoreScope]] = []
        self.bad: Any = None

    def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any:
        self.asked.append((byte_length, scope))
        if self.bad is not None:
            return self.bad
        buffer = np.empty(byte_length, np.uint8)
        self.buffers.append(buffer)
        return buffer

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any:
        if self.refuse_restore:
            raise ValueError("incompatible state")
        adopted = self.buffers[-1]
        assert np.shares_memory(np.frombuffer(payload, np.uint8), adopted)  # no copy
        self.staged.append(bytes(payload))
        return adopted

    async def activate_restore(self, token: Any) -> None:
        self.state = token.tobytes()


def coordinator(store: FileStore, participants: list[Any], epoch: str = "e1") -> Coordinator:
    return Coordinator(
        store, RecordingBus(), participants, session_id="s", epoch=epoch, describe=describe
    )


def mixed(size: int = 0) -> list[Any]:
    """Half in place, half the classic copy out of a view."""
    return [InPlace(name, size) if i % 2 == 0 else Part(name) for i, name in enumerate(NAMES)]


async def saved(tmp_path: Path, size: int = 0) -> tuple[list[Any], dict[str, bytes]]:
    participants = mixed(size)
    async with FileStore(tmp_path) as store, coordinator(store, participants) as host:
        await host.checkpoint(10)
    return participants, {p.name: p.state for p in participants}


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, BIG])
async def test_each_payload_is_read_into_the_memory_its_participant_provides(
    tmp_path: Path, size: int
) -> None:
    _, states = await saved(tmp_path, size)
    participants = mixed()
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        resumed = await host.resume()
        assert resumed.step == 10
    for participant in participants:
        assert participant.state == states[participant.name]
        if isinstance(participant, InPlace):
            [(length, scope)] = participant.asked
            assert length == len(states[participant.name])
            assert (scope.checkpoint_id, scope.step) == ("e1-10", 10)
            assert scope.epoch == host.epoch


def file_of(tmp_path: Path) -> Path:
    [generation] = tmp_path.glob("*.flysess")
    return generation


def offsets(data: bytes) -> dict[str, int]:
    """Where to flip a bit: the manifest, the table, each payload, the footer."""
    manifest_bytes, count, table_offset = struct.unpack_from("<3I", data, 16)
    where = {
        "manifest": HEADER_BYTES + manifest_bytes // 2,
        "table": table_offset + 70,
        "footer-digest": len(data) - FOOTER_BYTES + 10,
        "footer-length": len(data) - FOOTER_BYTES,
    }
    for index in range(count):
        _, offset, length, _ = struct.unpack_from("<64sQQ32s", data, table_offset + 112 * index)
        if length:
            where[f"payload-{index}-end"] = offset + length - 1
            where[f"payload-{index}-start"] = offset
    return where


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [0, BIG])
async def test_a_flipped_bit_anywhere_is_refused_before_a_participant_sees_a_byte(
    tmp_path: Path, size: int
) -> None:
    await saved(tmp_path, size)
    generation = file_of(tmp_path)
    original = generation.read_bytes()
    for index, (label, at) in enumerate(offsets(original).items()):
        flipped = bytearray(original)
        flipped[at] ^= 0x01
        generation.write_bytes(flipped)
        participants = mixed()
        before = [p.state for p in participants]
        epoch = f"h{index}"
        async with FileStore(tmp_path) as store, coordinator(store, participants, epoch) as host:
            with pytest.raises(GenerationCorruptError):
                await host.restore("e1-10", new_epoch="e6")
        assert all(p.staged == [] and p.aborted == 0 for p in participants), label
        assert [p.state for p in participants] == before, label
    generation.write_bytes(original)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "bad",
    [bytes(8), bytearray(3), np.empty((4, 4), np.uint8)[:, ::2], "not memory"],
    ids=["read-only", "wrong-length", "strided", "not-a-buffer"],
)
async def test_a_bad_buffer_fails_the_restore_before_anything_is_staged(
    tmp_path: Path, bad: Any
) -> None:
    await saved(tmp_path)
    participants = mixed()
    participants[0].bad = bad
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        with pytest.raises(RestoreFailedError) as failed:
            await host.restore("e1-10", new_epoch="e6")
        assert failed.value.participant == participants[0].name
        assert "restore_buffer" in str(failed.value)
        assert all(p.staged == [] for p in participants)
        assert host.epoch == "e5"
        # nothing changed: the next restore, with a good buffer, goes through
        participants[0].bad = None
        await host.restore("e1-10", new_epoch="e7")
        assert host.epoch == "e7"


class Copier(Part):
    """No restore_buffer: it copies out of the view it is handed."""

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any:
        self.readonly = payload.readonly
        self.view = payload
        return bytes(payload)


@pytest.mark.asyncio
async def test_without_a_buffer_the_view_is_read_only_memory_released_after(
    tmp_path: Path,
) -> None:
    """A participant without ``restore_buffer`` gets a read-only view of memory
    the restore allocated for that payload alone (not a map of the file: a
    later change to the file cannot reach what it copied), released after."""
    _, states = await saved(tmp_path, BIG)
    copiers = [Copier(name) for name in NAMES]
    async with FileStore(tmp_path) as store, coordinator(store, copiers, "e5") as host:
        await host.restore("e1-10", new_epoch="e6")
        generation = file_of(tmp_path)
        with generation.open("r+b") as changed:
            changed.write(b"\xff" * 4096)
    for copier in copiers:
        assert copier.readonly
        assert copier.state == states[copier.name]
        with pytest.raises(ValueError, match="released"):
            bytes(copier.view)


@pytest.mark.asyncio
async def test_a_truncated_or_shrunk_file_is_refused(tmp_path: Path) -> None:
    await saved(tmp_path, BIG)
    generation = file_of(tmp_path)
    original = generation.read_bytes()
    for index, cut in enumerate((len(original) - 1, len(original) // 2, HEADER_BYTES + 3)):
        generation.write_bytes(original[:cut])
        participants = mixed()
        epoch = f"h{index}"
        async with FileStore(tmp_path) as store, coordinator(store, participants, epoch) as host:
            with pytest.raises(GenerationCorruptError):
                await host.restore("e1-10", new_epoch="e6")
        assert all(p.staged == [] for p in participants)


class Sharing(InPlace):
    """Its restore_buffer hands out (part of) one shared array."""

    shared = np.empty(1 << 20, np.uint8)

    def __init__(self, name: str, start: int) -> None:
        super().__init__(name)
        self.start = start

    def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any:
        return self.shared[self.start : self.start + byte_length]


@pytest.mark.asyncio
@pytest.mark.parametrize("second_start", [0, 3])
async def test_buffers_that_overlap_fail_the_restore_naming_the_second(
    tmp_path: Path, second_start: int
) -> None:
    """Two participants handed the same (or overlapping) memory: one payload
    would be read over the other after it was hashed."""
    await saved(tmp_path)
    participants = [Part(name) for name in NAMES]
    participants[0] = Sharing(NAMES[0], 0)
    participants[2] = Sharing(NAMES[2], second_start)
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        with pytest.raises(RestoreFailedError, match="overlaps") as failed:
            await host.restore("e1-10", new_epoch="e6")
        assert failed.value.participant == NAMES[2]
        assert all(p.staged == [] for p in participants)


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["grow", "shrink"])
async def test_a_file_that_changes_length_during_the_restore_is_refused_as_length(
    tmp_path: Path, change: str
) -> None:
    """The file grows or shrinks between the head's read and the rest (from
    restore_buffer, which runs in between): ``length``, as ``read`` names it."""
    await saved(tmp_path, BIG)
    generation = file_of(tmp_path)
    size = generation.stat().st_size

    class Changer(InPlace):
        def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any:
            with generation.open("r+b") as file:
                if change == "grow":
                    file.seek(0, os.SEEK_END)
                    file.write(bytes(4096))
                else:
                    file.truncate(size // 2)
            return super().restore_buffer(byte_length, scope)

    participants = mixed()
    participants[0] = Changer(NAMES[0])
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        with pytest.raises(GenerationCorruptError) as refused:
            await host.restore("e1-10", new_epoch="e6")
        assert refused.value.check == "length"
        assert all(p.staged == [] for p in participants)


def rewrite(tmp_path: Path, change: Any) -> None:
    """Change the generation's bytes and record its new digest in the store
    manifest, so the envelope's own checks are what refuses it."""
    generation = file_of(tmp_path)
    data = bytearray(generation.read_bytes())
    change(data)
    generation.write_bytes(data)
    manifest = tmp_path / "manifest.json"
    text = manifest.read_text()
    import hashlib
    import json

    record = json.loads(text)
    for entry in record["generations"]:
        entry["envelopeDigest"] = hashlib.sha256(data).hexdigest()
    import rfc8785

    manifest.write_bytes(rfc8785.dumps(record))


@pytest.mark.asyncio
async def test_a_deeply_nested_manifest_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    await saved(tmp_path)

    def nest(data: bytearray) -> None:
        (manifest_bytes,) = struct.unpack_from("<I", data, 16)
        deep = b"[" * 1000 + b"]" * 1000
        data[HEADER_BYTES : HEADER_BYTES + manifest_bytes] = deep.ljust(manifest_bytes, b" ")

    rewrite(tmp_path, nest)
    participants = mixed()
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        with pytest.raises(GenerationCorruptError):
            await host.restore("e1-10", new_epoch="e6")
        assert all(p.staged == [] for p in participants)


@pytest.mark.asyncio
async def test_a_structural_failure_is_refused_without_copying_the_file(tmp_path: Path) -> None:
    """A bit flipped in a payload's name: the table fails part way, and the
    digests taken during the read still serve; the file is never joined into
    one copy to be hashed again."""
    import tracemalloc

    await saved(tmp_path, BIG)

    def rename(data: bytearray) -> None:
        _, _, table_offset = struct.unpack_from("<3I", data, 16)
        data[table_offset + 112 * 2] ^= 0x20  # lower case to upper case: not an Id

    rewrite(tmp_path, rename)
    participants = [Part(name) for name in NAMES]  # (the memory they are given is not traced)
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        tracemalloc.start()
        try:
            with pytest.raises(GenerationCorruptError) as refused:
                await host.restore("e1-10", new_epoch="e6")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert refused.value.check.startswith("envelope:")
        assert peak < BIG, peak


def mapped_sizes() -> list[int]:
    sizes = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        sizes.append(high - low)
    return sizes


@pytest.mark.asyncio
async def test_a_kept_error_does_not_keep_the_refused_payloads_memory(tmp_path: Path) -> None:
    odd = (5 << 20) + 12345  # a size no other mapping has
    rounded = (odd + 4095) // 4096 * 4096
    participants = [Part(name) for name in NAMES]
    participants[1].state = os.urandom(odd)
    async with FileStore(tmp_path) as store, coordinator(store, participants) as host:
        await host.checkpoint(10)
    # The saved state itself may be a mapping of that size (malloc maps a block
    # this large while its threshold is low, as in a process of its own): gone.
    del participants, host
    gc.collect()
    assert rounded not in mapped_sizes()
    generation = file_of(tmp_path)
    data = bytearray(generation.read_bytes())
    data[len(data) // 2] ^= 0x01
    generation.write_bytes(data)
    del data
    kept: list[BaseException] = []
    async with FileStore(tmp_path) as store, coordinator(store, mixed(), "e5") as host:
        try:
            await host.restore("e1-10", new_epoch="e6")
        except GenerationCorruptError as error:
            kept.append(error)
        assert kept
        assert rounded not in mapped_sizes()


def documented_world() -> Any:
    """examples/resumable_host.py's World: the participant docs/host.md builds."""
    path = Path(__file__).parent.parent / "examples" / "resumable_host.py"
    spec = importlib.util.spec_from_file_location("resumable_host", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.World


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ["corrupt", "other-buffer"])
async def test_a_refused_restore_frees_the_memory_the_documented_world_provided(
    tmp_path: Path, bad: str
) -> None:
    """The guide's world, restored from a file that fails its digest, or with another
    participant's buffer refused: the array its restore_buffer gave is freed, even
    while the error is kept (it was held until the next restore: one more copy of
    the state for a host that went on without it)."""
    world_type = documented_world()
    with_world = [world_type(64), *(Part(name) for name in NAMES[1:])]
    async with FileStore(tmp_path) as store, coordinator(store, with_world) as host:
        await host.checkpoint(10)
    if bad == "corrupt":
        generation = file_of(tmp_path)
        data = bytearray(generation.read_bytes())
        data[len(data) // 2] ^= 0x01
        generation.write_bytes(data)
    provided: list[weakref.ref[Any]] = []

    class Watched(world_type):  # type: ignore[misc, valid-type]
        def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any:
            array = super().restore_buffer(byte_length, scope)
            provided.append(weakref.ref(array))
            return array

    others = [InPlace(name) for name in NAMES[1:]]
    if bad == "other-buffer":
        others[-1].bad = bytes(8)  # read-only: refused after the world's was given
    kept: list[BaseException] = []
    watched = [Watched(64), *others]
    async with FileStore(tmp_path) as store, coordinator(store, watched, "e5") as host:
        try:
            await host.restore("e1-10", new_epoch="e6")
        except (GenerationCorruptError, RestoreFailedError) as error:
            kept.append(error)
        gc.collect()
        assert kept and len(provided) == 1
        assert provided[0]() is None


@pytest.mark.asyncio
async def test_a_corrupt_newest_checkpoint_names_the_older_ones_to_choose_from(
    tmp_path: Path,
) -> None:
    """resume() never passes over a corrupt newest checkpoint, and its error names
    the older ones, newest first, with the call that restores one: the guide's host
    was left with "move the store aside" (helper-22). A named one names none."""
    async with FileStore(tmp_path) as store, coordinator(store, mixed()) as host:
        for step in (10, 20, 30):
            await host.checkpoint(step)
    [newest] = tmp_path.glob("e1-30*.flysess")
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(data)
    participants = mixed()
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        with pytest.raises(GenerationCorruptError) as refused:
            await host.resume()
        assert refused.value.code == "store.corrupt"
        assert refused.value.checkpoint_id == "e1-30"
        assert refused.value.older == ("e1-20", "e1-10")
        assert "restore('e1-20', new_epoch=...)" in str(refused.value)
        assert all(p.staged == [] for p in participants)
        with pytest.raises(GenerationCorruptError) as named:
            await host.restore("e1-30", new_epoch=host.fresh_epoch())
        assert named.value.older == () and "e1-20" not in str(named.value)
        report = await host.restore(refused.value.older[0], new_epoch=host.fresh_epoch())
        assert report.record.checkpoint_id == "e1-20"


class CancelsItsRestore(InPlace):
    """Cancels the task running the restore the asyncio way (``task.cancel()``:
    what Ctrl-C under asyncio.run, or asyncio.wait_for timing out, does), from
    ``when``: ``"read"`` (while a thread reads the file) or ``"activate"``."""

    def __init__(self, name: str, when: str) -> None:
        super().__init__(name)
        self.when = when
        self.task: asyncio.Task[Any] | None = None

    def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any:
        if self.when == "read" and self.task is not None:  # while a thread reads the file
            asyncio.get_running_loop().call_later(0.01, self.task.cancel)
        return super().restore_buffer(byte_length, scope)

    async def activate_restore(self, token: Any) -> None:
        if self.when == "activate" and self.task is not None:
            self.task.cancel()
            await asyncio.sleep(0.01)  # (where the cancel used to land)
        await super().activate_restore(token)


def generation_fds() -> list[str]:
    fds = Path("/proc/self/fd")
    return [t for fd in fds.iterdir() if (t := os.path.realpath(fd)).endswith(".flysess")]


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["read", "activate"])
async def test_asyncios_own_cancel_of_a_restore_leaves_it_whole_or_not_begun(
    tmp_path: Path, when: str
) -> None:
    """An anyio shield keeps out anyio's cancellations only. asyncio's own, landing
    while participants activated, left them in the checkpoint's state and the
    coordinator in the old epoch, fenced (helper-21: 5 of 5; 4 of 4 real Ctrl-Cs);
    landing while a thread read the file, restore() raised with the thread still
    reading an fd it had closed, or dropped the file its thread had opened."""
    _, states = await saved(tmp_path, 32 << 20)  # (read long enough to cancel under)
    participants: list[Any] = [CancelsItsRestore(NAMES[0], when), *mixed()[1:]]
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        task = asyncio.ensure_future(host.restore("e1-10", new_epoch="e6"))
        participants[0].task = task
        with pytest.raises(asyncio.CancelledError):
            await task
        reading = [t.name for t in threading.enumerate() if t.name.startswith("restore-")]
        assert reading == [] and generation_fds() == []
        if when == "activate":  # taken whole: the new epoch, its fork recorded
            assert host.epoch == "e6" and [p.state for p in participants] == list(states.values())
            assert (store.session("s") or pytest.fail()).epoch("e6") is not None
            assert isinstance(await host.checkpoint(20), Committed)
        else:  # not begun: nothing staged, the old epoch goes on
            assert host.epoch == "e5" and all(p.staged == [] for p in participants)
            assert isinstance(await host.checkpoint(20), Committed)
    assert generation_fds() == []


@pytest.mark.asyncio
async def test_asyncios_own_cancel_at_any_moment_of_a_restore_leaves_no_file_open(
    tmp_path: Path,
) -> None:
    """Cancels 0-4 ms into a restore (seeded): the file a worker thread opened was
    dropped open, with its shared lock, when the cancel landed in that thread's
    wait (helper-21: 50 of 300)."""
    await saved(tmp_path, 1 << 20)
    chooser = random.Random(7)
    for trial in range(80):
        async with FileStore(tmp_path) as store, coordinator(store, mixed(), f"c{trial}") as host:
            restoring = host.restore("e1-10", new_epoch=f"d{trial}")
            await cancelled_soon(restoring, chooser.uniform(0, 0.004))
        gc.collect()
        assert generation_fds() == [], trial


class SlowAbort(Part):
    """Its abort takes a while, and cancels the restore the asyncio way meanwhile."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.task: asyncio.Task[Any] | None = None

    async def abort_restore(self, token: bytes) -> None:
        if self.task is not None:
            self.task.cancel()
        await asyncio.sleep(0.01)
        await super().abort_restore(token)


@pytest.mark.asyncio
async def test_asyncios_own_cancel_during_the_abort_still_aborts_every_staged_one(
    tmp_path: Path,
) -> None:
    """A refused restore aborts what staged; asyncio's cancel landing in the first
    abort cut it short, and the second staged participant was never told
    (helper-23: 6 of 6; 11 of 16 real Ctrl-Cs)."""
    await saved(tmp_path)
    participants = [SlowAbort(NAMES[0]), *(Part(name) for name in NAMES[1:])]
    participants[2].refuse_restore = True
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        task = asyncio.ensure_future(host.restore("e1-10", new_epoch="e6"))
        participants[0].task = task
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [p.aborted for p in participants] == [1, 1, 0, 0, 0]
        assert host.epoch == "e5" and isinstance(await host.checkpoint(20), Committed)


class SlowActivate(Part):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.activating = asyncio.Event()

    async def activate_restore(self, token: bytes) -> None:
        self.activating.set()
        await asyncio.sleep(0.3)
        await super().activate_restore(token)


@pytest.mark.asyncio
async def test_a_close_cut_by_asyncio_waits_for_the_restore_it_found(tmp_path: Path) -> None:
    """aclose() under asyncio.wait_for while a restore activates: the close went on
    while the restore ran, and the restore's fork failed on a closed store (every
    participant live in the checkpoint, the old epoch fenced) or its event was never
    published (helper-23: 6 of 6)."""
    _, states = await saved(tmp_path)
    participants = [SlowActivate(NAMES[0]), *(Part(name) for name in NAMES[1:])]
    bus = RecordingBus()
    async with FileStore(tmp_path) as store:
        host = Coordinator(store, bus, participants, session_id="s", epoch="e5", describe=describe)
        await host.__aenter__()
        restoring = asyncio.ensure_future(host.restore("e1-10", new_epoch="e6"))
        await participants[0].activating.wait()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(host.aclose(), 0.05)
        assert restoring.done() and (await restoring).epoch == "e6"
    assert [p.state for p in participants] == list(states.values())
    async with FileStore(tmp_path) as store:
        assert (store.session("s") or pytest.fail()).epoch("e6") is not None
    assert [type(e).__name__ for e in bus.events] == ["Restored"]


@pytest.mark.asyncio
@pytest.mark.parametrize("at", ["magic", "table"])
async def test_a_head_that_cannot_be_laid_out_is_refused_without_a_map(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    """A damaged head was read the ordinary way: the file mapped and hashed, where
    another process truncating it killed the host with SIGBUS (helper-21: 7 of 9)."""
    from coordinator.fs import FileSystem

    await saved(tmp_path, BIG)
    generation = file_of(tmp_path)
    data = bytearray(generation.read_bytes())
    data[0 if at == "magic" else offsets(bytes(data))["table"]] ^= 0xFF
    generation.write_bytes(data)

    def no_map(self: FileSystem, fd: int) -> Any:
        raise AssertionError("mapped")

    monkeypatch.setattr(FileSystem, "map", no_map)
    async with FileStore(tmp_path) as store, coordinator(store, mixed(), "e5") as host:
        with pytest.raises(GenerationCorruptError) as refused:
            await host.restore("e1-10", new_epoch="e6")
    assert refused.value.check == "envelope-digest"


@pytest.mark.asyncio
@pytest.mark.parametrize("failing", [1, 2], ids=["head", "digest"])
async def test_a_read_error_in_a_damaged_heads_checks_is_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    """EIO while the head is read, or while a damaged head's file is hashed: a raw
    OSError reached the host (the final review's own attack)."""
    import errno

    from coordinator.fs import FileSystem

    await saved(tmp_path)
    generation = file_of(tmp_path)
    data = bytearray(generation.read_bytes())
    data[0] ^= 0xFF
    generation.write_bytes(data)
    calls = [0]
    read_into = FileSystem.read_into

    def fails(self: FileSystem, fd: int, view: memoryview, offset: int) -> int:
        calls[0] += 1
        if calls[0] >= failing:
            raise OSError(errno.EIO, "Input/output error")
        return read_into(self, fd, view, offset)

    async with FileStore(tmp_path) as store, coordinator(store, mixed(), "e5") as host:
        monkeypatch.setattr(FileSystem, "read_into", fails)
        with pytest.raises(GenerationCorruptError) as refused:
            await host.restore("e1-10", new_epoch="e6")
        monkeypatch.undo()
        assert refused.value.check == "read" and "Input/output error" in str(refused.value)
        assert generation_fds() == []


class Grid:
    """docs/host.md's numpy world: its restore_buffer is an array like its own."""

    name = "world"

    def __init__(self, grid: Any) -> None:
        self.grid, self.asked = grid, []

    async def capture(self, scope: Any) -> Any:
        return self.grid

    def restore_buffer(self, byte_length: int, scope: RestoreScope) -> Any:
        self.asked.append(byte_length)
        self.incoming = np.empty_like(self.grid)
        return self.incoming

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any:
        return self.incoming

    async def activate_restore(self, token: Any) -> None:
        self.grid = token

    async def abort_restore(self, token: Any) -> None:
        pass


@pytest.mark.asyncio
async def test_a_corrupt_length_in_the_table_is_the_files_fault_not_the_participants(
    tmp_path: Path,
) -> None:
    """helper-45: a bit flipped in the last payload's table length (9801 -> 9800)
    still lays out (alignment's slack before the footer), so restore_buffer was
    asked for 9800 bytes, its array of 9801 was refused, and resume() blamed the
    participant (restore.failed) with no older checkpoint named. The file is
    checked before a participant is blamed: store.corrupt, naming the older one."""
    from coordinator import HostDescription
    from coordinator.bus import MemoryBus

    def host(store: FileStore, world: Grid, epoch: str) -> Coordinator:
        return Coordinator(store, MemoryBus(), [world], session_id="s", epoch=epoch,
                           describe=HostDescription(agents=[]))  # fmt: skip

    first = Grid(np.ones((99, 99), np.uint8))
    async with FileStore(tmp_path) as store, host(store, first, "e1") as h:
        await h.checkpoint(1)
        await h.checkpoint(2)
    newest = sorted(tmp_path.glob("*.flysess"), key=lambda p: p.stat().st_mtime)[-1]
    data = bytearray(newest.read_bytes())
    _, _, table_offset = struct.unpack_from("<3I", data, 16)
    data[table_offset + 72] ^= 0x01  # the length field of entry 0 (8 bytes at 72)
    newest.write_bytes(data)
    world = Grid(np.ones((99, 99), np.uint8))
    async with FileStore(tmp_path) as store, host(store, world, "e2") as h:
        with pytest.raises(GenerationCorruptError) as caught:
            await h.resume()
    assert caught.value.check == "envelope-digest" and caught.value.older == ("e1-1",)
    assert world.asked == [9800]  # (asked, then checked: a participant saw no byte)


NO_MEMORY_CHILD = """
import asyncio, resource, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from hostkit import Part
from coordinator import Coordinator, CoordinatorError, FileStore, HostDescription
from coordinator.bus import MemoryBus

class Plain(Part):
    pass

def vm():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

async def main(folder, size, epoch, limit):
    world = Plain("world")
    world.state = b"live" if limit else bytes(size)
    async with FileStore(folder) as store, Coordinator(
        store, MemoryBus(), [world], session_id="s", epoch=epoch,
        describe=HostDescription(agents=[])) as host:
        if not limit:
            await host.checkpoint(1)
            return
        resource.setrlimit(resource.RLIMIT_AS, (vm() + (128 << 20), resource.RLIM_INFINITY))
        try:
            await host.resume()
        except CoordinatorError as error:
            print(error.code, str(error))
        except BaseException as error:
            print("untyped", type(error).__name__, error)
        print("live", world.state[:8])

asyncio.run(main(sys.argv[1], 256 << 20, sys.argv[4], sys.argv[4] == "e2"))
"""


def test_a_payload_too_large_for_the_memory_left_is_a_typed_refusal(tmp_path: Path) -> None:
    """helper-45: a payload with no restore_buffer is read into memory of the
    store's own; with too little left (RLIMIT_AS in a child) resume() raised the
    OS's bare OSError (ENOMEM). It is restore.failed, and the live state stays."""
    import subprocess
    import sys

    tests = Path(__file__).parent
    for epoch in ("e1", "e2"):
        done = subprocess.run(
            [sys.executable, "-c", NO_MEMORY_CHILD, str(tmp_path), str(tests),
             str(tests.parent), epoch],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("restore.failed "), done.stdout
    assert "no memory to read payload 'world'" in done.stdout
    assert "live b'live'" in done.stdout


class Held(Part):
    """A participant with no restore_buffer, holding ``data``."""

    def __init__(self, name: str, data: bytes) -> None:
        super().__init__(name)
        self.state = data


ORPHAN = 5 << 20  # five chunks of the scratch (1 MiB): each reused twice


async def saved_with_an_orphan(tmp_path: Path, size: int = ORPHAN) -> bytes:
    """A checkpoint of a 64 KiB grid and a payload ("scratch", 5 MiB) of a
    participant the later host no longer has. Returns the orphan's bytes."""
    from coordinator import HostDescription
    from coordinator.bus import MemoryBus

    orphan = os.urandom(size)
    parts = [Grid(np.arange(1 << 16, dtype=np.uint8)), Held("scratch", orphan)]
    async with FileStore(tmp_path) as store, Coordinator(
        store, MemoryBus(), parts, session_id="s", epoch="e1",
        describe=HostDescription(agents=[])) as host:  # fmt: skip
        await host.checkpoint(1)
    return orphan


async def resume_without_the_orphan(tmp_path: Path, epoch: str = "e2") -> Grid:
    from coordinator import HostDescription
    from coordinator.bus import MemoryBus

    world = Grid(np.zeros(1 << 16, dtype=np.uint8))
    async with FileStore(tmp_path) as store, Coordinator(
        store, MemoryBus(), [world], session_id="s", epoch=epoch,
        describe=HostDescription(agents=[])) as host:  # fmt: skip
        await host.resume()
    return world


@pytest.mark.asyncio
@pytest.mark.parametrize("flip", [None, 1, 2 << 20, (4 << 20) + 5])
async def test_a_payload_no_participant_takes_is_verified_in_bounded_memory(
    tmp_path: Path, flip: int | None
) -> None:
    """helper-45 (b2): a payload of a participant removed since was read whole
    into memory of the restore's own (+256 MiB at the peak for 256 MiB of it).
    It goes through two chunks of scratch now: every byte still verified (a bit
    flipped in any chunk of it is refused), the others restored."""
    orphan = await saved_with_an_orphan(tmp_path)
    if flip is not None:
        generation = file_of(tmp_path)
        data = bytearray(generation.read_bytes())
        data[data.index(orphan[:4096]) + flip] ^= 0x10
        generation.write_bytes(data)
        with pytest.raises(GenerationCorruptError):
            await resume_without_the_orphan(tmp_path)
        return
    world = await resume_without_the_orphan(tmp_path)
    assert bytes(world.grid) == bytes(np.arange(1 << 16, dtype=np.uint8))


PEAK_CHILD = """
import asyncio, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from pathlib import Path
from test_staged_restore import resume_without_the_orphan

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

open("/proc/self/clear_refs", "w").write("5")
start = kib("VmRSS")
asyncio.run(resume_without_the_orphan(Path(sys.argv[1])))
print((kib("VmHWM") - start) / 1024)
"""


@pytest.mark.asyncio
async def test_a_payload_no_participant_takes_adds_at_most_the_scratch_to_the_peak(
    tmp_path: Path,
) -> None:
    """An orphan of 64 MiB: the peak over the start grows by the scratch's 2 MiB
    (and the read's own pieces) at most, not by the orphan (measured as `coordinator bench restore` does, in
    a child: VmHWM after clear_refs)."""
    import subprocess
    import sys

    await saved_with_an_orphan(tmp_path, 64 << 20)
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", PEAK_CHILD, str(tmp_path), str(tests), str(tests.parent)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) < 16, done.stdout  # (MiB: the scratch, threads, the grid)


@pytest.mark.asyncio
async def test_no_memory_for_the_scratch_leaves_no_hashing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-46: the two hashing threads were started before the scratch was
    allocated, outside the block that stops them: each restore refused for want
    of that memory left two threads blocked for good (and said nothing: a bare
    MemoryError has no text)."""
    import threading

    from coordinator.store import _staged

    def no_memory(self: Any, streams: Any) -> None:
        raise MemoryError

    await saved_with_an_orphan(tmp_path)
    monkeypatch.setattr(_staged._Scratch, "__init__", no_memory)
    for epoch in ("e2", "e3"):
        with pytest.raises(RestoreFailedError, match="no memory for the restore's own buffers"):
            await resume_without_the_orphan(tmp_path, epoch)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("restore-")]


HASH_FAILS_CHILD = """
import asyncio, hashlib, sys, threading, types
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from pathlib import Path
from coordinator.store import _staged
from test_staged_restore import resume_without_the_orphan

class FailsOnce:
    armed = True
    def __init__(self, inner=None):
        self.inner = inner or hashlib.sha256()
    def update(self, data):
        if FailsOnce.armed and threading.current_thread().name == "restore-payloads":
            FailsOnce.armed = False
            raise MemoryError
        self.inner.update(data)
    def copy(self):
        return FailsOnce(self.inner.copy())
    def digest(self):
        return self.inner.digest()

_staged.hashlib = types.SimpleNamespace(sha256=FailsOnce)
try:
    asyncio.run(resume_without_the_orphan(Path(sys.argv[1])))
except Exception as error:
    print(getattr(error, "code", type(error).__name__))
"""


@pytest.mark.asyncio
async def test_a_hashing_threads_error_ends_the_restore_with_it(tmp_path: Path) -> None:
    """helper-46: a job of a hashing thread that raised (a MemoryError in its
    update) killed the thread; with a payload passed over, the read waited for
    good on a chunk the dead thread would never say it was done with (and could
    not be cancelled). The thread goes on; its error ends the restore: here
    restore.failed. (In a child: a hang must not hang the suite.)"""
    import subprocess
    import sys

    await saved_with_an_orphan(tmp_path)
    tests = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", HASH_FAILS_CHILD, str(tmp_path), str(tests), str(tests.parent)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "restore.failed", done.stdout


class StagesWithoutWaiting(Grid):
    """docs/host.md's world, whose stage_restore (or activate_restore, with
    ``at_activate``) never waits: it cancels the caller's anyio scope (``scope``)."""

    scope: Any = None
    at_activate = False

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> Any:
        if self.scope is not None and not self.at_activate:
            self.scope.cancel()
        return self.incoming

    async def activate_restore(self, token: Any) -> None:
        if self.scope is not None and self.at_activate:
            self.scope.cancel()
        self.grid = token


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["read", "stage", "activate"])
async def test_an_anyio_cancel_before_step_3_aborts_when_nothing_waits_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """helper-47 (c4): a scope cancelled while a worker thread read the file (or
    while a participant staged) was to be delivered again after the shield, at
    the next wait. With none before step 3 (a stage_restore that never waits),
    the restore installed, and the scope never learned it was cancelled. Before
    step 3 a cancellation aborts and changes nothing (docs/runtime.md). helper-48:
    one from step 3 on was never raised either; it is, after step 5."""
    import anyio
    from coordinator import HostDescription
    from coordinator.bus import MemoryBus
    from coordinator.store import _staged

    await saved_with_an_orphan(tmp_path, 1 << 20)
    reading, go_on = threading.Event(), threading.Event()
    real_read = _staged.StagedRead.read

    def held_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        reading.set()
        go_on.wait(10)
        return real_read(self, *args, **kwargs)

    if when == "read":
        monkeypatch.setattr(_staged.StagedRead, "read", held_read)
    world = StagesWithoutWaiting(np.full(1 << 16, 9, dtype=np.uint8))
    async with FileStore(tmp_path) as store, Coordinator(
        store, MemoryBus(), [world], session_id="s", epoch="e2",
        describe=HostDescription(agents=[])) as host:  # fmt: skip
        with anyio.CancelScope() as scope:
            if when == "read":
                async with anyio.create_task_group() as group:
                    group.start_soon(host.resume)
                    await anyio.to_thread.run_sync(reading.wait)
                    scope.cancel()
                    go_on.set()
            else:
                world.scope, world.at_activate = scope, when == "activate"
                await host.resume()
        assert scope.cancelled_caught
        if when == "activate":  # taken whole: restored, then the cancellation raised
            assert host.epoch != "e2" and bytes(world.grid) == bytes(range(256)) * 256
        else:
            assert host.epoch == "e2" and bytes(world.grid) == bytes([9]) * (1 << 16)
        assert isinstance(await host.checkpoint(5), Committed)  # the old epoch goes on
    assert [t.name for t in threading.enumerate() if t.name.startswith("restore-")] == []
    assert generation_fds() == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("flip", "refusal"), [(None, RuntimeError), ((2 << 20) + 7, RuntimeError), (None, MemoryError)]
)
async def test_a_hashing_thread_that_cannot_start_leaves_none_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flip: int | None, refusal: type[Exception]
) -> None:
    """helper-47 (c2): the hashing threads were started outside the block that
    stops them: the second refused ("can't start new thread": a thread limit)
    left the first waiting for good, and the restore raised a bare RuntimeError.
    The read hashes in its own thread then, as a small read does; every byte is
    still verified. helper-48: CPython's start() raises MemoryError too (no memory
    for the thread's start-up)."""
    orphan = await saved_with_an_orphan(tmp_path, 3 << 20)
    if flip is not None:
        generation = file_of(tmp_path)
        data = bytearray(generation.read_bytes())
        data[data.index(orphan[:4096]) + flip] ^= 0x10
        generation.write_bytes(data)
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == "restore-payloads":
            raise refusal("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    if flip is None:
        world = await resume_without_the_orphan(tmp_path)
        assert bytes(world.grid) == bytes(np.arange(1 << 16, dtype=np.uint8))
    else:
        with pytest.raises(GenerationCorruptError):
            await resume_without_the_orphan(tmp_path)
    assert [t.name for t in threading.enumerate() if t.name.startswith("restore-")] == []


class ClosesItsHost(Part):
    """Closes the coordinator from inside its own stage_restore or activate_restore."""

    def __init__(self, name: str, when: str, how: str = "aclose") -> None:
        super().__init__(name)
        self.when, self.how, self.host, self.refused = when, how, None, []

    async def _close(self) -> None:
        try:
            if self.how == "aexit":  # (an AsyncExitStack that entered it, closed here)
                await self.host.__aexit__(None, None, None)  # type: ignore[attr-defined]
            else:
                await self.host.aclose()  # type: ignore[attr-defined]
        except Exception as error:
            self.refused.append(error)
            raise

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        if self.host is not None and self.when == "stage":
            await self._close()
        return await super().stage_restore(payload, scope)

    async def activate_restore(self, token: bytes) -> None:
        if self.host is not None and self.when == "activate":
            await self._close()
        await super().activate_restore(token)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("when", "how"), [("stage", "aclose"), ("activate", "aclose"), ("stage", "aexit")]
)
async def test_aclose_inside_its_own_restore_is_refused_not_a_hang(
    tmp_path: Path, when: str, how: str
) -> None:
    """A participant closing the coordinator from inside its own restore waited
    for that restore, which waited for it: for ever, and no deadline reached it
    (the waits are shielded). It is a UsageError, and the restore fails as a
    raising participant makes it fail. helper-50: the block's end (``__aexit__``)
    there hung still."""
    import anyio

    from coordinator.errors import UsageError

    participants: list[Any] = [ClosesItsHost(NAMES[0], when, how), *mixed()[1:]]
    async with FileStore(tmp_path) as store, coordinator(store, participants, "e5") as host:
        await host.checkpoint(1)
        participants[0].host = host
        with anyio.fail_after(10), pytest.raises(RestoreFailedError):
            await host.restore("e5-1", new_epoch="e6")
        assert [type(e) for e in participants[0].refused] == [UsageError]
        participants[0].host = None
        if when == "stage":  # aborted before step 3: the old epoch goes on
            assert isinstance(await host.checkpoint(2), Committed)
    await host.aclose()  # (closed: a second close returns)


class RestoresAnother(Part):
    """Its stage_restore restores another coordinator (``other``) first."""

    other: Any = None

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        if self.other is not None:
            await self.other.restore("e5-1", new_epoch="e6")
        return await super().stage_restore(payload, scope)


@pytest.mark.asyncio
async def test_a_close_inside_a_nested_restore_of_another_is_refused_not_a_hang(
    tmp_path: Path,
) -> None:
    """helper-50: A's participant restored B, and B's participant closed A. The
    context knew B's restore alone, so A's close waited for A's restore, which
    waited for it: for ever. Every restore the code runs inside counts."""
    import anyio

    from coordinator.errors import UsageError

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    inner = ClosesItsHost(NAMES[0], "stage")
    outer = RestoresAnother(NAMES[0])
    hosts = []
    for folder, first in (("a", outer), ("b", inner)):
        store = await FileStore(tmp_path / folder).__aenter__()
        host = await coordinator(store, [first, *mixed()[1:]], "e5").__aenter__()
        await host.checkpoint(1)
        hosts.append((store, host))
    (_, a), (_, b) = hosts
    inner.host, outer.other = a, b
    with anyio.fail_after(10), pytest.raises(RestoreFailedError):  # (B's restore failed in it)
        await a.restore("e5-1", new_epoch="e6")
    assert [type(e) for e in inner.refused] == [UsageError]
    for store, host in reversed(hosts):
        await host.aclose()
        await store.aclose()


class LeavesACloser(Part):
    """The first restore's stage leaves a task behind, which closes the host when
    told (``go``); a later restore's stage waits (``staging``) a while."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.host: Any = None
        self.go, self.staging = asyncio.Event(), asyncio.Event()
        self.left: asyncio.Task[Any] | None = None

    async def stage_restore(self, payload: memoryview, scope: RestoreScope) -> bytes:
        if self.left is None:
            self.left = asyncio.ensure_future(self._close_later())
        else:
            self.staging.set()
            await asyncio.sleep(0.5)
        return await super().stage_restore(payload, scope)

    async def _close_later(self) -> str:
        await self.go.wait()
        await self.host.aclose()
        return "closed"


@pytest.mark.asyncio
async def test_a_task_left_by_an_earlier_restore_may_close_during_a_later_one(
    tmp_path: Path,
) -> None:
    """helper-50: a task a participant started in restore 1 inherited its context,
    and its aclose() during restore 2 (which it is no part of) was refused."""
    participant = LeavesACloser(NAMES[0])
    async with FileStore(tmp_path) as store:
        host = coordinator(store, [participant, *mixed()[1:]], "e5")
        participant.host = await host.__aenter__()
        await host.checkpoint(1)
        await host.restore("e5-1", new_epoch="e6")
        second = asyncio.ensure_future(host.restore("e5-1", new_epoch="e7"))
        await participant.staging.wait()
        participant.go.set()
        assert participant.left is not None and await participant.left == "closed"
        with pytest.raises(WriterClosedError):  # (the close found it before step 3)
            await second

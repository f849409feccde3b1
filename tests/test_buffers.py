"""Small-data hashing keeps the GIL (``buffers.feed``): the digest must be the one
``hashlib`` gives for the same bytes, whatever the size, shape or item format."""

import array
import hashlib
import os

import pytest

from coordinator.buffers import KEEP_GIL_BELOW, feed, sha256_of

SIZES = [0, 1, 2046, 2047, 2048, 4095, 4096, 4097, 3 * 2047, KEEP_GIL_BELOW - 1, KEEP_GIL_BELOW,
         KEEP_GIL_BELOW + 1]


@pytest.mark.parametrize("size", SIZES)
def test_the_digest_is_hashlibs_at_every_size(size: int) -> None:
    data = os.urandom(size)
    assert sha256_of(data).hexdigest() == hashlib.sha256(data).hexdigest()
    assert sha256_of(bytearray(data)).digest() == hashlib.sha256(data).digest()
    assert sha256_of(memoryview(data)).digest() == hashlib.sha256(data).digest()


def test_a_typed_buffer_is_hashed_as_its_bytes() -> None:
    doubles = array.array("d", range(1000))  # 8000 bytes of item format "d"
    assert sha256_of(doubles).digest() == hashlib.sha256(doubles.tobytes()).digest()
    shaped = memoryview(os.urandom(4096)).cast("B", (64, 64))
    assert sha256_of(shaped).digest() == hashlib.sha256(shaped.tobytes()).digest()


def test_feed_continues_a_hasher() -> None:
    first, second = os.urandom(5000), os.urandom(3000)
    hasher = hashlib.sha256(b"prefix")
    feed(hasher, first)
    feed(hasher, second)
    assert hasher.digest() == hashlib.sha256(b"prefix" + first + second).digest()


def test_a_buffer_hashlib_refuses_is_refused_as_before() -> None:
    strided = memoryview(os.urandom(8192))[::2]  # not contiguous
    with pytest.raises(BufferError):
        hashlib.sha256(strided)
    with pytest.raises(BufferError):
        sha256_of(strided)


class _FailsOnSecondPiece:
    """A hasher whose second update raises, as a Ctrl-C between pieces would."""

    def __init__(self) -> None:
        self.updates = 0

    def update(self, data: object) -> None:
        del data  # (hashlib's update has no frame to keep its argument in)
        self.updates += 1
        if self.updates == 2:
            raise KeyboardInterrupt


@pytest.mark.parametrize("size", [64, 4096, KEEP_GIL_BELOW + 1])
def test_a_refused_buffer_is_let_go_while_its_error_is_handled(size: int) -> None:
    """The error's traceback keeps feed's frame: its view must be released, or the
    caller cannot resize its bytearray (or close its map) in the except block."""
    data = bytearray(os.urandom(size))
    strided = memoryview(data)[::2]
    try:
        sha256_of(strided)
    except BufferError:
        strided.release()
        data.extend(b"more")  # BufferError while feed's view is alive
    else:
        pytest.fail("a non-contiguous buffer was hashed")


def test_an_interrupt_between_pieces_lets_the_buffer_go() -> None:
    data = bytearray(os.urandom(8192))
    try:
        feed(_FailsOnSecondPiece(), data)
    except KeyboardInterrupt:
        data.extend(b"more")
    else:
        pytest.fail("the hasher's interrupt was lost")

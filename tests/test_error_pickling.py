"""Every error the coordinator raises survives pickling: a host run in a process
pool (a parameter sweep) gets its worker's error back whole. Before, 20 of the
52 classes failed to unpickle (``__init__`` called with ``args`` alone), and a
ProcessPoolExecutor then lost the error."""

from __future__ import annotations

import copy
import errno
import inspect
import pickle
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from coordinator import errors
from coordinator.errors import CoordinatorError, GenerationCorruptError, SaveFailedError

# A plausible value for each parameter name an error class takes.
VALUES: dict[str, Any] = {
    "participant": "agent-fly-a",
    "reason": "its capture raised RuntimeError('boom')",
    "checkpoint_id": "epoch-1-7",
    "operation": "fsync",
    "path": "/var/lib/sim/store/epoch-1-7.flysess",
    "error": OSError(errno.EIO, "Input/output error"),
    "what": None,
    "step": 5,
    "check": "envelope-digest",
    "detail": "its SHA-256 is not the one the store manifest recorded",
    "offset": 64,
    "expected": "ab" * 32,
    "actual": "cd" * 32,
    "phase": "capture",
    "older": ("epoch-1-6", "epoch-1-5"),
    "asked": ("epoch-1-7", 7),
    "answered": ("epoch-1-6", 6),
    "found": "ef" * 32,
    "differences": (("agents", "fly-a", "fly-b"),),
    "skipped": ("helper",),
    "kind": "Id",
    "value": "not an id!",
    "position": 12,
    "remote_code": "capture.failed",
    "bucket": "coordinator-replicas",
    "tainted": ("world", "agent-fly-a"),
    "error_code": "store.fsync",
    "earlier": ("epoch-1-3",),
    "earlier_count": 1,
}


def error_classes() -> list[type[CoordinatorError]]:
    classes = [getattr(errors, name) for name in errors.__all__]
    return [c for c in classes if isinstance(c, type) and issubclass(c, CoordinatorError)]


def made(kind: type[CoordinatorError]) -> CoordinatorError:
    parameters = list(inspect.signature(kind.__init__).parameters.values())[1:]
    if parameters and parameters[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return kind("a message of its own")
    return kind(**{p.name: VALUES[p.name] for p in parameters if p.name in VALUES})


def same(one: BaseException, other: BaseException) -> bool:
    return (
        type(one) is type(other)
        and str(one) == str(other)
        and one.args == other.args
        and vars(one).keys() == vars(other).keys()
        and all(repr(vars(one)[k]) == repr(vars(other)[k]) for k in vars(one))
    )


def test_every_error_class_is_covered() -> None:
    assert len(error_classes()) >= 50


@pytest.mark.parametrize("kind", error_classes(), ids=lambda kind: kind.__name__)
def test_an_error_survives_pickling_and_copying(kind: type[CoordinatorError]) -> None:
    error = made(kind)
    error.add_note("raised in worker 3")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert same(error, again), kind.__name__
        assert again.code == error.code and again.__notes__ == ["raised in worker 3"]


def _fail_to_save(checkpoint_id: str) -> None:
    raise SaveFailedError(checkpoint_id, "store.fsync", "fsync failed: EIO", earlier=("epoch-1-3",))


def _fail_to_read(checkpoint_id: str) -> None:
    raise GenerationCorruptError(checkpoint_id, "/store/x.flysess", "read", "EIO", older=("a-1",))


def test_a_process_pool_hands_a_workers_error_back_whole() -> None:
    """A real worker process raises; the parent catches the very error, typed."""
    with ProcessPoolExecutor(max_workers=1) as pool:
        with pytest.raises(SaveFailedError) as saved:
            pool.submit(_fail_to_save, "epoch-1-9").result()
        with pytest.raises(GenerationCorruptError) as read:
            pool.submit(_fail_to_read, "a-2").result()
    assert saved.value.checkpoint_id == "epoch-1-9" and saved.value.code == "save.failed"
    assert saved.value.error_code == "store.fsync"
    assert tuple(read.value.older) == ("a-1",) and read.value.check == "read"

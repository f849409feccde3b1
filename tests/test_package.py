"""The package's public face."""

from __future__ import annotations

import inspect
import subprocess
import sys

import coordinator
from coordinator import errors


def test_all_matches_the_public_namespace() -> None:
    """__all__ lists exactly the public, non-module names of the package."""
    public = {
        name
        for name, value in vars(coordinator).items()
        if not name.startswith("_")
        and not inspect.ismodule(value)
        and name not in ("TYPE_CHECKING", "Any")
    } | set(coordinator._LAZY)
    assert set(coordinator.__all__) == public
    for name in coordinator.__all__:
        assert getattr(coordinator, name) is not None
    assert coordinator.__all__ == sorted(coordinator.__all__)


def test_dir_lists_every_public_name_before_it_is_loaded() -> None:
    """A fresh interpreter's dir(coordinator) and completion show the lazy names
    (Coordinator, FileStore...: a host author looked for them there and missed them)."""
    code = "import coordinator; print(sorted(set(coordinator.__all__) - set(dir(coordinator))))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_every_error_has_a_distinct_stable_code() -> None:
    """Each class of the error tree carries its own code, rooted at CoordinatorError."""
    classes = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value) and issubclass(value, errors.CoordinatorError)
    ]
    codes = [cls.code for cls in classes]
    assert len(codes) == len(set(codes))
    assert all(code and code == code.lower() for code in codes)


def test_corrupt_input_errors_are_value_errors() -> None:
    """Callers who already catch ValueError catch corrupt input too."""
    for cls in (errors.CorruptEnvelopeError, errors.JsonError, errors.ManifestError):
        assert issubclass(cls, ValueError)

"""Children that die with their parent: the embedded ``nats-server``, the demo's worker.
And Python children that run the very ``coordinator`` their parent runs.

On Linux the kernel sends a child a signal when its parent dies
(``PR_SET_PDEATHSIG``). That call must run in the child before the exec, and
``preexec_fn`` is no place for it: Python documents it as unsafe while other
threads run (the child can deadlock on a lock one of them held at the fork), and
hosts run worker threads. So the child is a tiny Python (``-I -S``) that makes the
call, checks that its parent is still the one that started it (or the signal
could never come), and execs the command, which keeps the setting and the pid.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["python_command", "with_parent_death_signal"]

# argv: the signal, the parent's pid, then the command. PR_SET_PDEATHSIG is 1; the
# setting survives the exec (of a program that is not set-uid).
_PDEATHSIG_SHIM = """\
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1])) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[2]):
    sys.exit("the parent died before its child started")
os.execv(sys.argv[3], sys.argv[3:])
"""


def with_parent_death_signal(
    command: list[str], signum: signal.Signals = signal.SIGTERM
) -> list[str]:
    """``command`` (its first item a path) run so that, on Linux, the kernel sends
    it ``signum`` when this process dies: even a killed parent leaves no child
    behind. The signal is tied to the thread that started the child (the kernel's
    rule): start children from a thread that lives as long as they do, as the
    event loop's does. Elsewhere, or without a Python executable to run the shim,
    ``command`` as it is: a killed parent then leaves its child running (an
    orderly stop still ends it)."""
    if sys.platform != "linux" or not sys.executable:
        return command
    shim = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SHIM]
    return [*shim, str(int(signum)), str(os.getpid()), *command]


# The directory this package was imported from.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_command(*arguments: str) -> list[str]:
    """``python *arguments`` (``-c CODE ...``, ``-m MODULE ...``) that imports the
    ``coordinator`` this process runs. Python puts the working directory first on
    such a child's path, so a package of that name there (a checkout of another
    version) was imported instead: ``-P`` keeps it off, unless this process found
    the package only there (a checkout run without installing it)."""
    started_at = sys.path if sys.flags.safe_path else sys.path[1:]  # [0]: our own start
    elsewhere = any(entry and os.path.abspath(entry) == _ROOT for entry in started_at)
    return [sys.executable, *(["-P"] if elsewhere else []), *arguments]

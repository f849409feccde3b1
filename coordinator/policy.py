"""When to checkpoint: every N steps, every T seconds, on demand, or any mix.

The host asks ``policy.due(step, now)`` at each committed step boundary and,
after a capture was accepted, tells the policy with ``taken(step, now)``
(``Coordinator.at_boundary`` does both). The rules:

- ``every_steps=N`` is due at the multiples of N: at 20, 40, 60 with N=20 (not 0),
  whatever step the run started or resumed from. A multiple that passed without
  a capture being taken (the writer was busy) stays due at the next boundary,
  so a period is never silently skipped.
- ``every_seconds=T`` is due once T seconds have passed since the last capture
  taken (or since the first boundary the policy saw).
- ``request()`` makes the next boundary due, once.
- ``restored(step)`` says the run went back to ``step`` (the coordinator says it
  after each restore): the step rule counts from there, so a run restored to 99
  is due at 100 again. A step below the last one taken means the same.
"""

from __future__ import annotations

__all__ = ["CapturePolicy"]


class CapturePolicy:
    def __init__(
        self, *, every_steps: int | None = None, every_seconds: float | None = None
    ) -> None:
        if every_steps is not None and (isinstance(every_steps, bool) or every_steps < 1):
            raise ValueError("every_steps must be at least 1")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError("every_seconds must be positive")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._requested = False
        self._covered: int | None = None  # multiples up to this step need no capture
        self._last_time: float | None = None

    def request(self) -> None:
        """Ask for a checkpoint at the next boundary (on demand)."""
        self._requested = True

    def due(self, step: int, now: float) -> bool:
        """Whether a checkpoint is due at this boundary (see the module's rules)."""
        if self._covered is None or step < self._covered:  # the first, or a restore
            self._covered = max(step - 1, 0)  # step 0 (the start) is no multiple
        if self._last_time is None:
            self._last_time = now
        if self._requested:
            return True
        every = self.every_steps
        if every is not None and step // every > self._covered // every:
            return True
        return self.every_seconds is not None and now - self._last_time >= self.every_seconds

    def restored(self, step: int) -> None:
        """The run went back to ``step`` (a restore): the step rule counts from
        there, so the next multiple after it is due (``Coordinator.restore`` tells
        its policy itself)."""
        self._covered = step

    def taken(self, step: int, now: float) -> None:
        """A checkpoint was captured at this boundary: periods restart from here."""
        self._covered, self._last_time = step, now
        self._requested = False

    def __repr__(self) -> str:
        options = {"every_steps": self.every_steps, "every_seconds": self.every_seconds}
        shown = ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)
        return f"CapturePolicy({shown or 'on demand'})"

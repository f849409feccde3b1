"""When to checkpoint: every N steps, every T seconds, on demand, or any mix.

The host asks ``policy.due(step, now)`` at each committed step boundary and,
after a capture was accepted, tells the policy with ``taken(step, now)``. A
capture that was refused (the writer was busy) is not ``taken``, so it stays
due at the next boundary instead of silently skipping a whole period.
"""

from __future__ import annotations

__all__ = ["CapturePolicy"]


class CapturePolicy:
    def __init__(
        self, *, every_steps: int | None = None, every_seconds: float | None = None
    ) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError("every_steps must be at least 1")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError("every_seconds must be positive")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._requested = False
        self._last_step: int | None = None
        self._last_time: float | None = None

    def request(self) -> None:
        """Ask for a checkpoint at the next boundary (on demand)."""
        self._requested = True

    def due(self, step: int, now: float) -> bool:
        """Whether a checkpoint is due at this boundary. The first call starts the
        clocks: periods count from the first boundary the policy sees."""
        if self._last_step is None or self._last_time is None:
            self._last_step, self._last_time = step, now
        if self._requested:
            return True
        if self.every_steps is not None and step - self._last_step >= self.every_steps:
            return True
        return self.every_seconds is not None and now - self._last_time >= self.every_seconds

    def taken(self, step: int, now: float) -> None:
        """A checkpoint was captured at this boundary: periods restart from here."""
        self._last_step, self._last_time = step, now
        self._requested = False

    def __repr__(self) -> str:
        options = {"every_steps": self.every_steps, "every_seconds": self.every_seconds}
        shown = ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)
        return f"CapturePolicy({shown or 'on demand'})"

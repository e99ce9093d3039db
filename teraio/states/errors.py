"""The one error of the states package: a one-line message naming what to do."""

from __future__ import annotations

from teraio.errors import UserInputError


class StatesError(UserInputError):
    """A misuse of ``states="offload"`` (an unsupported optimizer, a step after a failed one, ...)."""


class CheckpointError(StatesError):
    """A checkpoint or pretrained file that cannot be read, loaded or written as asked (one line)."""

"""The one error of the states package: a one-line message naming what to do."""

from __future__ import annotations

from teraio.errors import UserInputError


class StatesError(UserInputError):
    """A misuse of ``states="offload"`` (an unsupported optimizer, a step after a failed one, ...)."""

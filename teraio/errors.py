"""User-facing errors: anything raised as one of these reaches the CLI user as a one-line message, exit 2."""

from __future__ import annotations


class TeraioError(Exception):
    """Base class of teraio's own errors. The message is a complete sentence naming what to do."""


class UserInputError(TeraioError, ValueError):
    """Bad input from the user: a missing file, a malformed target, an option that does not parse."""


class CaptureError(TeraioError, RuntimeError):
    """The training step could not be captured or profiled."""

"""The ``teraio`` command line: one subcommand per module in ``teraio.commands``.

Each module there defines ``register(subparsers)``, which adds its parser and sets ``func`` (taking the
parsed args, returning an exit code). Errors the user can fix are raised as exceptions whose message is
one line; ``main`` prints it and exits with code 2, never a traceback. That covers argument errors,
the planner's format errors, the runtime's typed errors, unsafe outputs (``planner.safe_io``) and
``OSError`` from the filesystem (an unwritable output, a full disk).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Order is the order of ``teraio --help``.
COMMAND_MODULES = ["profile", "estimate", "synth", "plan", "simulate", "show", "sweep", "calibrate", "demo"]


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exception types whose message is meant for the user (one line, no traceback)."""
    from teraio.errors import TeraioError
    from teraio.planner.hardware import HardwareError
    from teraio.planner.plan import PlanError
    from teraio.planner.profile import ProfileError
    from teraio.planner.safe_io import OutputError

    types: list[type[BaseException]] = [TeraioError, ProfileError, PlanError, HardwareError, OutputError]
    for mod, name in (("teraio.planner.budget", "BudgetError"), ("teraio.runtime.errors", "RuntimeIOError")):
        # Only modules already loaded: an error of one never imported cannot be in flight, and importing
        # the runtime imports torch (a second before a one-line error that needed none).
        module = sys.modules.get(mod)
        if module is not None and hasattr(module, name):
            types.append(getattr(module, name))
    return tuple(types)


def _visible(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x85``, ``\\x1b``): arguments and
    file names may hold line breaks or terminal escapes, and an error must stay one plain line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class _Parser(argparse.ArgumentParser):
    """argparse with errors in one line (usage goes to ``--help``); subparsers inherit the class."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {_visible(message)} (see '{self.prog} --help')\n")


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and not isinstance(e, (RuntimeError, ValueError)) and e.strerror:
        where = f" '{e.filename}'" if e.filename else ""
        return _visible(f"{e.strerror}{where}")
    # Escaped, not cut at the first line break: the break may be inside a path the user gave.
    text = str(e).strip()
    return _visible(text) if text else type(e).__name__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="teraio",
        description="Plan and run activation offloading for PyTorch training (NVMe, GPUDirect Storage, host memory).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"teraio.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Page-aligned torch allocations for large tensors, so O_DIRECT reads land in fetched tensors without
    # a bounce copy (runtime/tiers/posix.py). torch reads it once, at its first CPU allocation.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed in one line)
        return e.code if isinstance(e.code, int) else 2
    try:
        code = args.func(args)
    except (*_user_error_types(), OSError) as e:
        print(f"teraio {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"teraio {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())

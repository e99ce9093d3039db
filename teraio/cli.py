"""The ``teraio`` command line: one subcommand per module in ``teraio.commands``.

Each module there defines ``register(subparsers)``, which adds its parser and sets ``func`` (taking the
parsed args, returning an exit code). Errors the user can fix are raised as exceptions whose message is
one line; ``main`` prints it and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Order is the order of ``teraio --help``.
COMMAND_MODULES = ["profile", "synth", "plan", "simulate", "show", "sweep", "calibrate", "demo"]


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exception types whose message is meant for the user (one line, no traceback)."""
    from teraio.errors import TeraioError
    from teraio.planner.hardware import HardwareError
    from teraio.planner.plan import PlanError
    from teraio.planner.profile import ProfileError

    types: list[type[BaseException]] = [TeraioError, ProfileError, PlanError, HardwareError]
    for mod, name in (("teraio.planner.budget", "BudgetError"), ("teraio.runtime.errors", "RuntimeIOError")):
        try:
            types.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except _user_error_types() as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"teraio {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"teraio {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())

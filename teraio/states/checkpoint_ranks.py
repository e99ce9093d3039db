"""A checkpoint under a process group: the collectives every rank takes part in, and the new directory
they write (Note: [A checkpoint is complete or absent] in teraio.states.checkpoint)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from teraio.lifecycle.ranks import RankAgreement
from teraio.planner.private_dir import PrivateDir
from teraio.states.errors import CheckpointError

# -- several ranks ---------------------------------------------------------------------------------------
#: Note: [A checkpoint of a DDP job]. One per process: its gloo group is made the first time a job needs it.
RANKS = RankAgreement()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's world size (0, 1 without a process group)."""
    if not RANKS.active():
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def on_every_rank(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on this rank; when any rank's raised, raise the first one's message on every rank (one
    rank's error must not leave the others waiting in the job's next collective)."""
    if not RANKS.active():
        return fn()
    own: Exception | None = None
    try:
        result, error = fn(), None
    except Exception as exc:  # any error (a refused step, a full disk), not only ours: the others must hear
        own, result = exc, None
        error = _failure(exc)
    errors = RANKS.gather_objects(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {message}") from own
    return result


# Note: [A checkpoint of a DDP job]
#     Under DDP every rank holds the same parameters and optimizer states, so rank 0 alone writes them,
#     once; the other ranks send it their random generators' states, which differ (dropout), and the
#     manifest records the job's world size. Every rank calls ``save_checkpoint`` and ``load_checkpoint``
#     (they are collectives, on teraio's gloo group: Note: [Ranks agree at the start of every step] in
#     teraio.lifecycle.ranks); every rank loads the same directory (a filesystem all ranks see) into its
#     own offload directory and restores its own generators. An error on one rank raises on every rank.
#     DDP broadcasts rank 0's parameters when it wraps a model: after a load that put them on disk, wrap
#     with ``DDP(model, init_sync=False)`` (every rank loaded the same values; there is nothing to send).
#     Under FSDP2 each rank writes its own shards instead (Note: [A checkpoint of an FSDP2 job] in
#     teraio.states.sharded_checkpoint).


def write_directory(target: str | os.PathLike, populate: Callable[[PrivateDir], None], *, what: str) -> Path:
    """Build the new directory ``target`` with ``populate(staged)`` and rename it into place (Note: [A
    checkpoint is complete or absent]).

    Raises:
        CheckpointError: ``target`` exists.
    """
    path = Path(os.path.abspath(os.fspath(target)))
    if os.path.lexists(path):
        raise CheckpointError(
            f"'{path}' exists: save each {what} to a new directory (say ckpt/step-000100); teraio does not "
            "replace it"
        )
    with PrivateDir.open(path.parent, what=f"the {what}'s parent directory") as parent:
        parent.create_subdir(path.name, populate)
    return path


class _RankFailed(CheckpointError):
    """A rank's error, already named by rank (Note: [A checkpoint of an FSDP2 job])."""


def _failure(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as exc:  # any error: the other ranks must hear of it
        return None, _failure(exc)


def write_together(
    directory: str | os.PathLike,
    own_files: Callable[[PrivateDir], dict[str, Any]],
    finish: Callable[[PrivateDir, list[dict[str, Any]]], None],
) -> Path:
    """Every rank writes ``own_files`` into the staging directory rank 0 made; rank 0 ``finish``es it with
    every rank's result and renames it (Note: [A checkpoint of an FSDP2 job] in
    teraio.states.sharded_checkpoint). The same collectives on every rank, whatever fails where."""
    rank, _ = rank_and_world()
    path = Path(os.path.abspath(os.fspath(directory)))
    error: str | None = None
    failure: BaseException | None = None
    if rank == 0:
        announced = False

        def populate(d: PrivateDir) -> None:
            nonlocal announced
            RANKS.gather_objects(str(d.path))
            announced = True
            results = RANKS.gather_objects(_attempt(lambda: own_files(d)))
            for r, (_, err) in enumerate(results):
                if err is not None:
                    raise _RankFailed(f"save_checkpoint failed on rank {r}: {err}")
            finish(d, [res for res, _ in results])

        try:
            write_directory(path, populate, what="checkpoint")
        except Exception as exc:
            failure = exc
            error = (
                str(exc)
                if isinstance(exc, _RankFailed)
                else f"save_checkpoint failed on rank 0: {_failure(exc)}"
            )
            if not announced:  # the others wait to hear where to write: nowhere
                RANKS.gather_objects(None)
    else:
        staged = RANKS.gather_objects(None)[0]
        if staged is not None:

            def open_and_write() -> dict[str, Any]:
                if not os.path.isdir(staged):
                    raise CheckpointError(
                        f"'{staged}' (rank 0's staging directory) is not on a filesystem this rank sees: every "
                        "rank must see the checkpoint directory"
                    )
                with PrivateDir.open(staged, what="the checkpoint's staging directory") as d:
                    return own_files(d)

            RANKS.gather_objects(_attempt(open_and_write))
    errors = RANKS.gather_objects(error)
    if errors[0] is not None:
        raise CheckpointError(errors[0]) from failure
    return path

"""Several processes of one job (``torchrun``): which rank this is, and agreement between ranks.

Each rank profiles and plans for its own memory (the planner is rank-agnostic: a rank's Profile in, its
Plan out). What the ranks must agree on is *when*: a rank that recompiles its graphs with a plan while
another is still profiling runs different code in the same step, and a rank that refuses a budget while
the others go on leaves them waiting in the next collective forever.

Note: [Ranks agree at the start of every step]
    At the first training forward of every step (no invocation in flight: between steps, never inside
    one), every rank of the job takes part in one small all-reduce on a process group of teraio's own,
    on the CPU (gloo), so it never waits for a device's queue. Every rank runs the same training steps
    (DDP and FSDP require it), so every rank makes that call the same number of times, whatever its
    phase; a collective only some ranks would make (only while profiling, say) hangs as soon as one rank
    sees a new shape the others do not. The all-reduce carries, in one vector: whether each rank has
    graphs ready to plan (MIN: plans are made only when every rank is ready, and then on every rank in
    the same step), and nothing else unless they plan. When they plan, a second all-reduce agrees on the
    budget in bytes (MIN of each rank's resolved budget: a fraction is of each rank's own unplanned peak,
    and the smallest wins, as DeepCompile does) and a third on whether every rank met it (MAX of
    failures: when one rank cannot, every rank raises the same one-line error instead of one rank
    raising and the others hanging).

Note: [teraio holds no process group]
    ``destroy_process_group`` unregisters the job's groups, but a group still referenced elsewhere is not
    destroyed: its gloo worker threads run on into interpreter exit, and a worker that drops the last
    reference to a collective's tensors there needs the GIL after Python is gone, which aborts the
    process ("terminate called without an active exception": docs/measured_facts.md). A reference held
    across groups would also be a destroyed group once the job makes new ones (``init_process_group``
    again in the same process). So teraio looks the default group up at each call and refers to a group
    of its own only weakly: the job's registry owns every group, and when the job destroys them, teraio
    has none left.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

log = logging.getLogger("teraio")

ReduceOp = Literal["min", "max", "sum"]


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its job: global and local rank and world sizes (1-process: 0, 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank_info() -> RankInfo:
    """This process's ranks: torch.distributed's when a process group is up, else ``torchrun``'s
    environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), else a single process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    # Without torchrun's variables (mp.spawn on one machine), every rank is on this node.
    local = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    return RankInfo(rank, world, local, max(1, local_world))


class RankAgreement:
    """The collectives of Note: [Ranks agree at the start of every step], on a gloo group: the job's
    default group when it is gloo, else one of teraio's own made the first time it is needed (every rank
    gets there at the same step). See Note: [teraio holds no process group]."""

    def __init__(self) -> None:
        # Weak: a group teraio made lives exactly as long as the job's registry keeps it.
        self._own: weakref.ref[Any] | None = None

    @staticmethod
    def active() -> bool:
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _pg(self) -> Any:
        dist = torch.distributed
        # CPU tensors on gloo: an all-reduce of a few numbers never waits for a GPU's queue. The default
        # group already is gloo on CPU-only jobs.
        if dist.get_backend() == "gloo":
            return dist.group.WORLD
        group = self._own() if self._own is not None else None
        if group is None:  # first use, or the job's groups were destroyed and made again
            group = dist.new_group(backend="gloo")
            self._own = weakref.ref(group)
        return group

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (small, picklable: these ranks' own data, never a file's), by rank."""
        if not self.active():
            return [value]
        out: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, value, group=self._pg())
        return out

    def reduce(self, values: Sequence[float], op: ReduceOp) -> list[float]:
        """Every rank's ``values`` combined elementwise with ``op`` (the values unchanged without a job)."""
        if not self.active():
            return list(values)
        dist = torch.distributed
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(
            t,
            op={"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op],
            group=self._pg(),
        )
        return t.tolist()

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, by rank."""
        if not self.active():
            return [value]
        dist = torch.distributed
        out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.tensor([value], dtype=torch.float64), group=self._pg())
        return [float(t.item()) for t in out]


def expand_dirs(spec: Any, info: RankInfo) -> list[str] | None:
    """A rank's offload directories from the ``offload_dirs`` option: a list whose entries may say
    ``{local_rank}`` or ``{rank}``, or a mapping from local rank to its directories (a list or one path).

    Raises:
        KeyError: the mapping names no directory for this local rank.
    """
    if spec is None:
        return None
    if isinstance(spec, dict):
        entry = spec[info.local_rank]
        dirs = [entry] if isinstance(entry, (str, os.PathLike)) else list(entry)
    else:
        dirs = list(spec)
    return [os.fspath(d).format(local_rank=info.local_rank, rank=info.rank) for d in dirs]


def disk_sharers(spec: Any, info: RankInfo) -> int:
    """How many local ranks put offload data on the disk(s) of this rank's first directory: the SSD's
    bandwidth is theirs to share. Local ranks' directories come from ``spec`` (teraio's default directory
    when None); a directory that does not exist yet counts by its nearest existing parent."""
    if info.local_world_size <= 1:
        return 1

    def device(path: str) -> int | None:
        p = os.path.abspath(path)
        while True:
            try:
                return os.stat(p).st_dev
            except OSError:
                parent = os.path.dirname(p)
                if parent == p:
                    return None
                p = parent

    def first_dir(local: int) -> str | None:
        other = RankInfo(info.rank - info.local_rank + local, info.world_size, local, info.local_world_size)
        try:
            dirs = expand_dirs(spec, other)
        except KeyError:
            return None
        if dirs is None:
            from teraio.runtime.config import default_offload_dir

            return str(default_offload_dir())
        return dirs[0] if dirs else None

    mine = device(first_dir(info.local_rank) or "")
    if mine is None:
        return 1
    return sum(1 for local in range(info.local_world_size) if device(first_dir(local) or "") == mine)

"""The options of ``teraio.backend(...)``: one dataclass with defaults, checked when it is built."""

from __future__ import annotations

import importlib.util
import math
import os
import stat
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from teraio.errors import UserInputError
from teraio.graph.compilers import InnerCompiler
from teraio.lifecycle.ranks import RankInfo, expand_dirs
from teraio.lifecycle.run_dir import refuse_foreign_run_dir
from teraio.platform.preflight import check_writable_dir

OnPlanMismatch = Literal["error", "reprofile"]
IOBackendName = Literal["auto", "posix", "kvikio", "host"]
TierName = Literal["ssd", "host"]
RecomputeOption = Literal["off", "only", "joint"]
StatesOption = Literal["keep", "offload"]
#: With states="offload" and a memory budget, which parameters and optimizer states stay in memory:
#: "plan" (what the whole-step budget leaves, chosen for the most I/O saved: Note: [The whole-step budget
#: keeps some states in memory] in teraio.states.residency), "none" (every one that can move, moves).
StatesKeepOption = Literal["plan", "none"]
#: ``hardware=CALIBRATE``: time the offload directory before the first plan instead of reading a file.
CALIBRATE = "calibrate"


def _is_module(value: object) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)


def _check_choice(name: str, value: Any, allowed: Any) -> None:
    choices = get_args(allowed)
    if value not in choices:
        raise UserInputError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


@dataclass
class BackendConfig:
    """Options of ``teraio.backend(...)`` (the README's option table says what each one does)."""

    memory_budget: str | int | float | None = None
    #: Directories, one per SSD; entries may say ``{local_rank}`` or ``{rank}``; or a mapping from local rank
    #: to its directories (teraio.lifecycle.ranks.expand_dirs).
    offload_dirs: list[str] | dict[int, list[str] | str] | None = None
    tiers: list[TierName] = field(default_factory=lambda: ["ssd"])
    solver: str = "ilp"
    time_limit: float = 30.0
    #: CP-SAT's deterministic time limit per graph (its own work units): plans that do not depend on the
    #: machine's load, for tests and reproducible runs; None: the wall clock (``time_limit``) alone.
    deterministic_time_limit: float | None = None
    solver_workers: int = 2  # CP-SAT worker threads; 1 with deterministic_time_limit: the same plan every run
    profile_steps: int = 3
    plan: str | None = None
    inner: InnerCompiler = "inductor"
    run_dir: str | None = None
    enabled: bool = True
    on_plan_mismatch: OnPlanMismatch = "error"
    #: A HardwareModel JSON (``teraio calibrate --out``), "calibrate" (measure the offload directory
    #: before the first plan, about a second), or None: the built-in model.
    hardware: str | None = None
    io_backend: IOBackendName | None = None  # None: TERAIO_IO_BACKEND or auto
    checksum: bool = True  # verify every fetched chunk (crc32c); False opts out
    measure_memory: bool = True  # measure one running step's peak with the torch profiler
    max_shapes: int = 8  # per dynamic graph: shapes profiled and planned; later shapes run unplanned
    #: Whether plans may rebuild saved tensors in backward instead of keeping or offloading them: "joint"
    #: (keep, offload or recompute, whichever is fastest under the budget), "only" (no offload), "off".
    #: None: each solver's default (teraio.planner.solve.default_recompute): "joint" with the solvers that
    #: plan recompute, "off" with the offload-only baselines.
    recompute: RecomputeOption | None = None
    runtime_options: dict[str, Any] = field(default_factory=dict)  # extra RuntimeConfig fields (tests)
    #: "offload": gradients and optimizer states of ``optimizer`` live on disk between uses and its step
    #: streams (teraio.states); "keep": they stay in memory, as without teraio.
    states: StatesOption = "keep"
    optimizer: Any = field(default=None, repr=False)  # a torch.optim.Optimizer, for states="offload"
    states_chunk_bytes: int | str = "64MiB"  # gradient + state bytes per chunk of the streamed step
    #: With states="offload", gradients on disk too between backward and the step; param.grad must then
    #: not be read before the step (Note: [Gradients stay readable unless asked] in teraio.states.grads).
    offload_gradients: bool = False
    #: With states="offload", each parameter updated inside backward once its gradient is complete, the
    #: gradient freed at once; opt.step() commits (teraio.states.optimizer_stream).
    optimizer_in_backward: bool = False
    #: With states="offload", the optimizer's parameters on disk too between the graph calls that compute
    #: with them (teraio.states.params); needs ``model`` (its state_dict and load_state_dict read and write
    #: them). Code outside the compiled graphs must not read them directly.
    offload_parameters: bool = False
    model: Any = field(default=None, repr=False)  # the torch.nn.Module the optimizer trains
    #: With offload_parameters, parameters smaller than this stay resident (norms, biases).
    states_min_param_bytes: int | str = "64KiB"
    states_keep: StatesKeepOption = "plan"

    def recorded(self) -> dict[str, Any]:
        """The options as written into the run directory: no runtime_options (test seams), the optimizer
        by its class name (``dataclasses.asdict`` would deep-copy it, parameters and all)."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("runtime_options", "optimizer", "model")
        }
        out["optimizer"] = None if self.optimizer is None else type(self.optimizer).__name__
        out["model"] = None if self.model is None else type(self.model).__name__
        return out

    def offload_dirs_for(self, info: RankInfo) -> list[str] | None:
        """This rank's offload directories (None: the runtime's default)."""
        try:
            return expand_dirs(self.offload_dirs, info)
        except KeyError:
            raise UserInputError(
                f"offload_dirs maps local ranks {sorted(self.offload_dirs)} to directories, not local rank "  # type: ignore[arg-type]
                f"{info.local_rank}: add it"
            ) from None

    def check_run_dir(self) -> None:
        """Refuse, in one line, a ``run_dir`` that is a non-empty directory teraio did not write (the
        backend would replace its config.json): see :mod:`teraio.lifecycle.run_dir`."""
        refuse_foreign_run_dir(self.run_dir)

    def __post_init__(self) -> None:
        _check_choice("inner", self.inner, InnerCompiler)
        _check_choice("on_plan_mismatch", self.on_plan_mismatch, OnPlanMismatch)
        if self.recompute is not None:
            _check_choice("recompute", self.recompute, RecomputeOption)
        if self.io_backend is not None:
            _check_choice("io_backend", self.io_backend, IOBackendName)
        if isinstance(self.tiers, str):
            self.tiers = [self.tiers]  # type: ignore[list-item]
        for t in self.tiers:
            _check_choice("each of tiers", t, TierName)
        if isinstance(self.profile_steps, bool) or int(self.profile_steps) < 1:
            raise UserInputError(
                f"profile_steps must be a whole number of at least 1, not {self.profile_steps!r}"
            )
        if isinstance(self.max_shapes, bool) or int(self.max_shapes) < 1:
            raise UserInputError(f"max_shapes must be a whole number of at least 1, not {self.max_shapes!r}")
        if isinstance(self.offload_dirs, (str, os.PathLike)):
            self.offload_dirs = [str(self.offload_dirs)]
        elif isinstance(self.offload_dirs, tuple):
            self.offload_dirs = list(self.offload_dirs)
        self._check_values()

    def _check_values(self) -> None:
        """Every option a user sets is checked here, when the backend is built, in one line naming the
        option and what to write instead: never steps later, after profiling and planning."""
        from teraio.planner.budget import BudgetError, parse_budget
        from teraio.planner.limits import MAX_WORKERS
        from teraio.planner.solve import solver_names

        if self.memory_budget is not None:
            try:
                parse_budget(self.memory_budget, "memory_budget")
            except BudgetError as exc:
                raise UserInputError(str(exc)) from None
        if self.solver not in solver_names():
            raise UserInputError(
                f"solver must be one of {', '.join(map(repr, solver_names()))}, not {self.solver!r}"
            )
        limit = self.time_limit
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
            raise UserInputError(f"time_limit must be a positive number of seconds, not {limit!r}")
        det = self.deterministic_time_limit
        if det is not None and (
            isinstance(det, bool) or not isinstance(det, (int, float)) or not 0 < det < math.inf
        ):
            raise UserInputError(
                f"deterministic_time_limit must be None or a positive number of CP-SAT's deterministic "
                f"seconds, not {det!r}"
            )
        workers = self.solver_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise UserInputError(
                f"solver_workers must be a whole number from 1 to {MAX_WORKERS}, not {workers!r}"
            )
        for name in ("enabled", "checksum", "measure_memory"):
            if not isinstance(getattr(self, name), bool):
                raise UserInputError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if not isinstance(self.runtime_options, dict):
            raise UserInputError(
                f"runtime_options must be a dict of RuntimeConfig fields, not {self.runtime_options!r}"
            )
        if self.io_backend == "kvikio" and importlib.util.find_spec("kvikio") is None:
            raise UserInputError(
                "io_backend='kvikio' needs kvikio, which is not installed: pip install 'teraio[gds]', or use "
                "io_backend='posix'"
            )
        if self.offload_dirs is not None:
            self._check_offload_dirs()
        self._check_states()

    def _check_states(self) -> None:
        _check_choice("states", self.states, StatesOption)
        _check_choice("states_keep", self.states_keep, StatesKeepOption)
        from teraio.planner.sizes import SizeError, nbytes_of

        try:
            chunk_nbytes = nbytes_of(self.states_chunk_bytes, "states_chunk_bytes")
        except SizeError as exc:
            raise UserInputError(str(exc)) from None
        if chunk_nbytes <= 0:
            raise UserInputError(f"states_chunk_bytes must be positive, not {self.states_chunk_bytes!r}")
        for name in ("offload_gradients", "optimizer_in_backward", "offload_parameters"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise UserInputError(f"{name} must be True or False, not {value!r}")
            if value and self.states != "offload":
                raise UserInputError(f"{name}=True needs states='offload' (and optimizer=opt)")
        if self.optimizer_in_backward and self.offload_gradients:
            raise UserInputError(
                "optimizer_in_backward=True frees each gradient once it is used, so there is none to offload: "
                "drop offload_gradients=True"
            )
        if self.offload_parameters and not _is_module(self.model):
            raise UserInputError(
                "offload_parameters=True needs the model: teraio.backend(states='offload', optimizer=opt, "
                "offload_parameters=True, model=model)"
            )
        try:
            min_param = nbytes_of(self.states_min_param_bytes, "states_min_param_bytes")
        except SizeError as exc:
            raise UserInputError(str(exc)) from None
        if min_param < 0:
            raise UserInputError(f"states_min_param_bytes must be >= 0, not {self.states_min_param_bytes!r}")
        if self.states == "offload" and self.optimizer is None:
            raise UserInputError(
                "states='offload' needs the optimizer: teraio.backend(states='offload', optimizer=opt)"
            )
        if self.optimizer is not None:
            from teraio.states.offload import check_optimizer

            check_optimizer(self.optimizer)

    def _check_offload_dirs(self) -> None:
        if not self.offload_dirs:
            raise UserInputError("offload_dirs is empty: name at least one directory, or leave it None")
        if isinstance(self.offload_dirs, dict):
            lists = []
            for local, entry in self.offload_dirs.items():
                if isinstance(local, bool) or not isinstance(local, int) or local < 0:
                    raise UserInputError(
                        f"offload_dirs: a mapping's keys are local ranks (0, 1, ...), not {local!r}"
                    )
                entries = [entry] if isinstance(entry, (str, os.PathLike)) else entry
                if not isinstance(entries, (list, tuple)) or not entries:
                    raise UserInputError(
                        f"offload_dirs[{local}] must be a directory or a list of them, not {entry!r}"
                    )
                lists.append([(local, d) for d in entries])
            pairs = [p for group in lists for p in group]
        else:
            pairs = [(0, d) for d in self.offload_dirs]
        for local, d in pairs:
            if not isinstance(d, (str, os.PathLike)):
                raise UserInputError(f"offload_dirs: {d!r} is not a path")
            try:  # a pattern is checked as local rank 0 (or the mapping's rank) would use it
                path = os.fspath(d).format(local_rank=local, rank=local)
            except (KeyError, IndexError, ValueError):
                raise UserInputError(
                    f"offload_dirs: {os.fspath(d)!r} has a placeholder other than {{local_rank}} or {{rank}}"
                ) from None
            problem = directory_problem(path)
            if problem is not None:
                raise UserInputError(f"offload_dirs: {problem}")
            # A real write (where the directory will be created: nothing is left behind): root passes every
            # permission check, and only a write finds a full disk.
            check_writable_dir(path, option="offload_dirs")


def directory_problem(path: object) -> str | None:
    """Why ``path`` cannot be a directory teraio writes into, in words, or None when it can: it is a
    directory, or can be created as one (its nearest existing ancestor is a directory), and this user may
    create files there. Nothing is created to find out."""
    if not isinstance(path, (str, os.PathLike)) or os.fspath(path) == "":
        return f"{path!r} is not a path"
    p = os.path.abspath(os.fspath(path))
    existing = p
    while True:
        try:
            st = os.stat(existing)
            break
        except FileNotFoundError:
            parent = os.path.dirname(existing)
            if parent == existing:
                return f"'{p}' cannot be created: no part of it exists"
            existing = parent
        except NotADirectoryError:
            existing = os.path.dirname(existing)
        except OSError as exc:
            return f"'{existing}' cannot be read ({exc.strerror}); name another directory"
    if not stat.S_ISDIR(st.st_mode):
        if existing == p:
            return f"'{p}' is a file, not a directory; name a directory"
        return f"'{p}' cannot be created: '{existing}' is a file, not a directory; name a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == p else f"cannot be created: '{existing}' is"
        return f"'{p}' {what} not writable by this user (or on a read-only filesystem); name a writable directory"
    return None


def make_config(**options: Any) -> BackendConfig:
    """The backend's configuration from keyword options (what ``TeraioBackend(**options)`` receives)."""
    return BackendConfig(**options)


"""The options of ``teraio.backend(...)``, grouped by concern: one frozen dataclass per concern, each field
documented under it and checked when it is built.

A flat list of keyword options let a user write combinations that cannot work (a solver time limit with
no solver that uses one, gradients on disk without offloaded states), and a third of the checks only
refused them. Here each concern is its own object: :class:`Solver` (how plans are made),
:class:`Profiling` (how the graphs are measured), :class:`teraio.states.config.States` (the optimizer's
states on disk; None: in memory), composed by :class:`BackendConfig`. An option that only means something
inside one concern cannot be written outside it.

The flat names of earlier releases still work for one release: :func:`make_config` folds each into its
object with a ``DeprecationWarning`` naming the new spelling (``DEPRECATED_OPTIONS``).

Importing this module does not import torch (``teraio`` exports these objects, and ``teraio --help``
must not pay for torch): the checks that need it import it when a config is built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import stat
import sys
import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_args

from teraio.errors import UserInputError

if TYPE_CHECKING:
    from teraio.graph.compilers import InnerCompiler
    from teraio.lifecycle.ranks import RankInfo
    from teraio.states.config import States

OnPlanMismatch = Literal["error", "reprofile"]
IOBackendName = Literal["auto", "posix", "kvikio", "host"]
TierName = Literal["ssd", "host"]
RecomputeOption = Literal["off", "only", "joint"]
#: Solver.partitioner_budget's value that searches (Note: [The partitioner's budget is part of the plan]
#: in teraio.lifecycle.partitioner_search).
PartitionerSearch = Literal["search"]
#: ``hardware=CALIBRATE``: time the offload directory before the first plan instead of reading a file.
CALIBRATE = "calibrate"


def _check_choice(name: str, value: Any, allowed: Any) -> None:
    choices = get_args(allowed)
    if value not in choices:
        raise UserInputError(f"{name} must be one of {', '.join(map(repr, choices))}, not {value!r}")


def _is_positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def _is_whole_at_least_1(value: object) -> bool:
    # Whole numbers as before (3, 3.0, "3" were accepted by int()); a bool is not a count.
    if isinstance(value, bool):
        return False
    try:
        return int(value) >= 1  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


def _check_solver_name(name: object, option: str) -> None:
    from teraio.planner.solve import solver_names

    if name not in solver_names():
        raise UserInputError(f"{option} must be one of {', '.join(map(repr, solver_names()))}, not {name!r}")


# ------------------------------------------------------------------------------------------- solver
#: Rounds of the partitioner search's trial at most: each round runs one step per finalist.
MAX_RUNOFF_ROUNDS = 50


@dataclass(frozen=True)
class Solver:
    """How each graph's plan is made: ``solver=teraio.Solver(name="ilp", time_limit=10)``.
    ``solver="greedy"`` is short for ``teraio.Solver(name="greedy")``."""

    name: str = "ilp"
    """A registered solver (``teraio.planner.solve.solver_names()``): "ilp" (CP-SAT: the best plan it finds
    within the time limit), "greedy", or the baselines "none" and "all"."""

    time_limit: float = 30.0
    """Wall-clock seconds the solver may spend per graph. Without ``deterministic_time_limit`` the ILP ends
    sooner once it has found no better plan for as long as its last better one took (Note: [A solve that
    stopped improving ends] in teraio.planner.solvers.ilp_model)."""

    deterministic_time_limit: float | None = None
    """CP-SAT's deterministic time limit per graph (its own work units): plans that do not depend on the
    machine's load, for tests and reproducible runs; None: the wall clock (``time_limit``) alone."""

    workers: int = 2
    """CP-SAT worker threads; 1 with ``deterministic_time_limit``: the same plan every run."""

    recompute: RecomputeOption | None = None
    """Whether plans may rebuild saved tensors in backward instead of keeping or offloading them: "joint"
    (keep, offload or recompute, whichever is fastest under the budget), "only" (no offload), "off".
    None: the solver's default (teraio.planner.solve.default_recompute): "joint" with the solvers that
    plan recompute, "off" with the offload-only baselines."""

    partitioner_budget: float | PartitionerSearch | None = None
    """The min-cut partitioner's own recompute (``torch._functorch.config.activation_memory_budget``: the
    share of the saved activations it keeps, recomputing the rest in backward, fused into Inductor's
    kernels), under teraio's plan: a ratio from 0 to 1; "search": the plan chooses it (with a memory
    budget, a step whose plan at the default partition moves or rebuilds tensors is profiled again at
    the ratio estimated to fit by the partitioner alone and one between, and runs the fastest predicted,
    or the fastest timed of those predicted close to it (``runoff_rounds``);
    Note: [The partitioner's budget is part of the plan] in teraio.lifecycle.partitioner_search); None:
    the process's ``activation_memory_budget`` (1.0 unless set)."""

    runoff_rounds: int = 3
    """With ``partitioner_budget="search"``: the candidates predicted within 15% of the fastest (at most
    three) run the training steps in turns, one step each per round, for this many rounds, and the one
    with the smallest median step runs from then on (Note: [The search's finalists are timed against each
    other] in teraio.lifecycle.partitioner_runoff); 0: the fastest predicted runs at once."""

    def __post_init__(self) -> None:
        from teraio.planner.limits import MAX_WORKERS

        _check_solver_name(self.name, "Solver.name")
        pb = self.partitioner_budget
        if (
            pb is not None
            and pb != "search"
            and not (isinstance(pb, (int, float)) and not isinstance(pb, bool) and 0.0 <= pb <= 1.0)
        ):
            raise UserInputError(
                f"Solver.partitioner_budget must be a ratio from 0 to 1, 'search' or None, not {pb!r}"
            )
        if not _is_positive_number(self.time_limit):
            raise UserInputError(
                f"Solver.time_limit must be a positive number of seconds, not {self.time_limit!r}"
            )
        det = self.deterministic_time_limit
        if det is not None and not _is_positive_number(det):
            raise UserInputError(
                f"Solver.deterministic_time_limit must be None or a positive number of CP-SAT's "
                f"deterministic seconds, not {det!r}"
            )
        workers = self.workers
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise UserInputError(
                f"Solver.workers must be a whole number from 1 to {MAX_WORKERS}, not {workers!r}"
            )
        if self.recompute is not None:
            _check_choice("Solver.recompute", self.recompute, RecomputeOption)
        rounds = self.runoff_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= MAX_RUNOFF_ROUNDS:
            raise UserInputError(
                f"Solver.runoff_rounds must be a whole number from 0 to {MAX_RUNOFF_ROUNDS}, not {rounds!r}"
            )


# ---------------------------------------------------------------------------------------- profiling
@dataclass(frozen=True)
class Profiling:
    """How each graph is measured before its plan: ``profiling=teraio.Profiling(steps=6)``."""

    steps: int = 3
    """Steps each graph is profiled for before it is planned: two timed op by op, the rest calibrating
    the op times against whole steps (Note: [Calibrated times] in teraio.profiling.op_timing)."""

    measure_memory: bool = True
    """Measure one running step's peak with the torch profiler (``stats()``' measured peak)."""

    max_shapes: int = 8
    """Per dynamic graph: the shapes profiled and planned; later shapes run unplanned."""

    def __post_init__(self) -> None:
        if not _is_whole_at_least_1(self.steps):
            raise UserInputError(f"Profiling.steps must be a whole number of at least 1, not {self.steps!r}")
        if not _is_whole_at_least_1(self.max_shapes):
            raise UserInputError(
                f"Profiling.max_shapes must be a whole number of at least 1, not {self.max_shapes!r}"
            )
        if not isinstance(self.measure_memory, bool):
            raise UserInputError(
                f"Profiling.measure_memory must be True or False, not {self.measure_memory!r}"
            )


# ------------------------------------------------------------------------------------------ backend
@dataclass(frozen=True)
class BackendConfig:
    """Every option of ``teraio.backend(...)`` (docs/options.md has the table): the backend's own, and one
    object per concern. Built once; normalised (a single tier or directory as a list, a solver name as a
    :class:`Solver`) and checked in ``__post_init__``."""

    memory_budget: str | int | float | None = None
    """The step's memory budget: bytes or a size ("512MiB"), a percentage or fraction of the unplanned
    peak ("50%", 0.5), "auto"; None: profile and run unplanned, no offload."""

    offload_dirs: list[str] | dict[int, list[str] | str] | None = None
    """Directories, one per SSD; entries may say ``{local_rank}`` or ``{rank}``; or a mapping from local
    rank to its directories (teraio.lifecycle.ranks.expand_dirs). None: the runtime's default."""

    tiers: list[TierName] = field(default_factory=lambda: ["ssd"])
    """Where offloaded tensors may go: "ssd" (the offload directories), "host" (host memory)."""

    io_backend: IOBackendName | None = None
    """How the SSD tier does I/O: "posix", "kvikio" (GDS), "host", "auto"; None: TERAIO_IO_BACKEND or auto."""

    checksum: bool = True
    """Verify every fetched chunk (crc32c); False opts out."""

    states: States | None = None
    """The optimizer's gradients, states (and parameters) on disk: a :class:`teraio.States`; None: they
    stay in memory, as without teraio."""

    solver: Solver = field(default_factory=Solver)
    """How plans are made (:class:`Solver`); a solver's name is short for ``Solver(name=...)``."""

    profiling: Profiling = field(default_factory=Profiling)
    """How graphs are measured before they are planned (:class:`Profiling`)."""

    inner: InnerCompiler = "inductor"
    """The compiler teraio hands the rewritten graphs to: "inductor", or "eager" (the FX-only path)."""

    enabled: bool = True
    """False: profile only, never offload (a reference run through the same compiler and the same phases:
    with a budget its graphs wait for the step's other profiles as the planned run's do)."""

    plan: str | None = None
    """A plan file or directory from an earlier run (``teraio plan``) to use instead of planning."""

    on_plan_mismatch: OnPlanMismatch = "error"
    """When ``plan`` was made for another graph: "error", or "reprofile" (profile and plan it afresh)."""

    hardware: str | None = None
    """A HardwareModel JSON (``teraio calibrate --out``), "calibrate" (measure the offload directory before
    the first plan, about a second on a quiet machine; later backends of the process reuse it for 15
    minutes), or None: the built-in model."""

    run_dir: str | None = None
    """Where the run is recorded (config.json, stats.jsonl, graphN/ profiles and plans); None: nowhere."""

    runtime_options: dict[str, Any] = field(default_factory=dict)
    """Extra RuntimeConfig fields for the engines (tests)."""

    def recorded(self) -> dict[str, Any]:
        """The options as written into the run directory's config.json: one nested dict per concern, no
        runtime_options (test seams), the optimizer and model by class name (``dataclasses.asdict`` would
        deep-copy them, parameters and all)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "runtime_options":
                continue
            if f.name == "states":
                value = None if value is None else value.recorded()
            elif f.name in ("solver", "profiling"):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out

    def offload_dirs_for(self, info: RankInfo) -> list[str] | None:
        """This rank's offload directories (None: the runtime's default)."""
        from teraio.lifecycle.ranks import expand_dirs

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
        from teraio.lifecycle.run_dir import refuse_foreign_run_dir

        refuse_foreign_run_dir(self.run_dir)

    def __post_init__(self) -> None:
        from teraio.graph.compilers import InnerCompiler

        _check_choice("inner", self.inner, InnerCompiler)
        _check_choice("on_plan_mismatch", self.on_plan_mismatch, OnPlanMismatch)
        if self.io_backend is not None:
            _check_choice("io_backend", self.io_backend, IOBackendName)
        # Frozen: the normalised values are set once, here.
        if isinstance(self.tiers, str):
            object.__setattr__(self, "tiers", [self.tiers])
        elif isinstance(self.tiers, tuple):
            object.__setattr__(self, "tiers", list(self.tiers))
        for t in self.tiers:
            _check_choice("each of tiers", t, TierName)
        if isinstance(self.offload_dirs, (str, os.PathLike)):
            object.__setattr__(self, "offload_dirs", [str(self.offload_dirs)])
        elif isinstance(self.offload_dirs, tuple):
            object.__setattr__(self, "offload_dirs", list(self.offload_dirs))
        if isinstance(self.solver, str):
            _check_solver_name(self.solver, "solver")
            object.__setattr__(self, "solver", Solver(name=self.solver))
        self._check_concerns()
        self._check_values()

    def _check_concerns(self) -> None:
        from teraio.states.config import States

        if not isinstance(self.solver, Solver):
            raise UserInputError(
                f"solver must be a solver's name or a teraio.Solver(...), not {self.solver!r}"
            )
        if not isinstance(self.profiling, Profiling):
            raise UserInputError(f"profiling must be a teraio.Profiling(...), not {self.profiling!r}")
        if self.states is not None and not isinstance(self.states, States):
            raise UserInputError(
                f"states must be one of None, teraio.States(optimizer=opt, ...), not {self.states!r}"
            )

    def _check_values(self) -> None:
        """Every option a user sets is checked here, when the backend is built, in one line naming the
        option and what to write instead: never steps later, after profiling and planning."""
        from teraio.planner.budget import BudgetError, parse_budget

        if self.memory_budget is not None:
            try:
                parse_budget(self.memory_budget, "memory_budget")
            except BudgetError as exc:
                raise UserInputError(str(exc)) from None
        for name in ("enabled", "checksum"):
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
        if self.solver.partitioner_budget == "search" and (self.memory_budget in (None, "auto") or self.plan):
            raise UserInputError(
                "Solver.partitioner_budget='search' compares plans within a memory_budget (bytes, units or a "
                "fraction, not 'auto') made by the backend, not read from plan=: set one, or give a ratio"
            )

    def _check_offload_dirs(self) -> None:
        from teraio.platform.preflight import check_writable_dir

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


def partitioner_budget_option(cfg: BackendConfig) -> float | None:
    """The partitioner budget a graph is first partitioned at: ``Solver.partitioner_budget`` when it is a
    ratio, else None (the process's setting; "search" starts there)."""
    pb = cfg.solver.partitioner_budget
    return None if pb is None or pb == "search" else float(pb)


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


# ---------------------------------------------------------------------------- deprecated flat names
#: The flat options of earlier releases, kept for this one: each names its concern and its field there.
#: ``states="offload"`` itself becomes ``states=teraio.States(...)``, ``states="keep"`` None.
DEPRECATED_OPTIONS: dict[str, tuple[str, str]] = {
    "time_limit": ("solver", "time_limit"),
    "deterministic_time_limit": ("solver", "deterministic_time_limit"),
    "solver_workers": ("solver", "workers"),
    "recompute": ("solver", "recompute"),
    "profile_steps": ("profiling", "steps"),
    "measure_memory": ("profiling", "measure_memory"),
    "max_shapes": ("profiling", "max_shapes"),
    "optimizer": ("states", "optimizer"),
    "model": ("states", "model"),
    "offload_gradients": ("states", "gradients"),
    "offload_parameters": ("states", "parameters"),
    "optimizer_in_backward": ("states", "optimizer_in_backward"),
    "states_chunk_bytes": ("states", "chunk_bytes"),
    "states_min_param_bytes": ("states", "min_param_bytes"),
    "states_keep": ("states", "keep"),
}
_CLASS_OF = {"solver": "Solver", "profiling": "Profiling", "states": "States"}
#: Shown by a placeholder in messages, not by their (long) repr.
_PLACEHOLDER = {"optimizer": "opt", "model": "model"}
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def make_config(**options: Any) -> BackendConfig:
    """The backend's configuration from keyword options (what ``teraio.backend(...)`` and
    ``TeraioBackend(**options)`` receive): the fields of :class:`BackendConfig` and, for this release, the
    flat names of earlier ones (``DEPRECATED_OPTIONS``), each folded into its object with a
    ``DeprecationWarning`` naming the new spelling.

    Raises:
        TypeError: an option that is neither a field nor a deprecated name.
        UserInputError: a value is refused, or a flat name is mixed with the object it moved into.
    """
    known = {f.name for f in fields(BackendConfig)}
    for name in options:
        if name not in known and name not in DEPRECATED_OPTIONS:
            raise TypeError(f"teraio.backend() got an unknown option {name!r} (docs/options.md lists them)")
    return BackendConfig(**_fold_deprecated(options))


def _warn_deprecated(message: str) -> None:
    # Point at the user's line: the first frame outside the teraio package (the call may come through
    # teraio.backend, TeraioBackend and make_config, or straight here).
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _fold_deprecated(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` in the new shape: each flat name moved into its object, with one warning per name."""
    out = {k: v for k, v in options.items() if k not in DEPRECATED_OPTIONS}
    flat = {k: v for k, v in options.items() if k in DEPRECATED_OPTIONS}
    offload = False
    if isinstance(out.get("states"), str) and out["states"] in ("keep", "offload"):  # the old spelling
        offload = out["states"] == "offload"
        new = "states=teraio.States(optimizer=opt)" if offload else "states=None (the default)"
        _warn_deprecated(f"states={out['states']!r} is deprecated: use {new}")
        out["states"] = None
    for name, value in flat.items():
        group, new_field = DEPRECATED_OPTIONS[name]
        shown = _PLACEHOLDER.get(name, repr(value))
        _warn_deprecated(
            f"{name}={shown} is deprecated: use {group}=teraio.{_CLASS_OF[group]}({new_field}={shown})"
        )
    moved = {
        group: {
            new_field: flat[name]
            for name, (g, new_field) in DEPRECATED_OPTIONS.items()
            if g == group and name in flat
        }
        for group in _CLASS_OF
    }
    if moved["solver"]:
        current = out.get("solver", "ilp")
        if isinstance(current, Solver):
            _refuse_mixed("solver", moved["solver"])
        if isinstance(current, str):
            _check_solver_name(current, "solver")
            out["solver"] = _built_from_flat(Solver, "solver", flat, name=current, **moved["solver"])
    if moved["profiling"]:
        if "profiling" in out:
            _refuse_mixed("profiling", moved["profiling"])
        out["profiling"] = _built_from_flat(Profiling, "profiling", flat, **moved["profiling"])
    if moved["states"] or offload:
        current = out.get("states")
        if current is not None and not isinstance(current, str):  # a States (a bad string fails later)
            _refuse_mixed("states", moved["states"])
        _check_flat_states(flat, offload)
        if offload:
            from teraio.states.config import States

            out["states"] = States(**moved["states"])
    return out


def _built_from_flat(cls: type[Any], group: str, flat: dict[str, Any], **kwargs: Any) -> Any:
    """``cls(**kwargs)``; a refused value is named as the user wrote it (``solver_workers``, not
    ``Solver.workers``): the messages of the objects start with ``Class.field``."""
    try:
        return cls(**kwargs)
    except UserInputError as exc:
        message = str(exc)
        for name, (g, f) in DEPRECATED_OPTIONS.items():
            prefix = f"{cls.__name__}.{f} "
            if g == group and name in flat and message.startswith(prefix):
                raise UserInputError(name + " " + message[len(prefix) :]) from None
        raise


def _refuse_mixed(group: str, moved: dict[str, Any]) -> None:
    cls = _CLASS_OF[group]
    written = ", ".join(f"{k}={_PLACEHOLDER.get(k, repr(v))}" for k, v in moved.items())
    olds = ", ".join(name for name, (g, f) in DEPRECATED_OPTIONS.items() if g == group and f in moved)
    raise UserInputError(
        f"{olds} and {group}=teraio.{cls}(...) both given: write teraio.{cls}({written}) alone"
    )


def _check_flat_states(flat: dict[str, Any], offload: bool) -> None:
    """The flat states options checked as they were, in one line naming them as the user wrote them
    (without states="offload" they are checked and then do nothing, as before)."""
    from teraio.states.config import StatesKeepOption

    for name in ("offload_gradients", "optimizer_in_backward", "offload_parameters"):
        value = flat.get(name, False)
        if not isinstance(value, bool):
            raise UserInputError(f"{name} must be True or False, not {value!r}")
        if value and not offload:
            raise UserInputError(f"{name}=True needs states='offload' (and optimizer=opt)")
    if flat.get("optimizer_in_backward") and flat.get("offload_gradients"):
        raise UserInputError(
            "optimizer_in_backward=True frees each gradient once it is used, so there is none to offload: "
            "drop offload_gradients=True"
        )
    _check_choice("states_keep", flat.get("states_keep", "plan"), StatesKeepOption)
    from teraio.sizes import SizeError, nbytes_of

    for name, least in (("states_chunk_bytes", 1), ("states_min_param_bytes", 0)):
        if name in flat:
            try:
                nbytes = nbytes_of(flat[name], name)
            except SizeError as exc:
                raise UserInputError(str(exc)) from None
            if nbytes < least:
                must = "must be positive" if least else "must be >= 0"
                raise UserInputError(f"{name} {must}, not {flat[name]!r}")
    if flat.get("offload_parameters"):
        import torch

        if not isinstance(flat.get("model"), torch.nn.Module):
            raise UserInputError(
                "offload_parameters=True needs the model: teraio.States(optimizer=opt, parameters=True, "
                "model=model)"
            )
    if offload and flat.get("optimizer") is None:
        raise UserInputError("states='offload' needs the optimizer: teraio.States(optimizer=opt)")
    if flat.get("optimizer") is not None:
        from teraio.states.offload import check_optimizer

        check_optimizer(flat["optimizer"], optimizer_in_backward=bool(flat.get("optimizer_in_backward")))

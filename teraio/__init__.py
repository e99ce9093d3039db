"""teraio: train PyTorch models whose activations do not fit in memory, with planned offload.

Use ``torch.compile(model, backend="teraio")`` or ``torch.compile(model, backend=teraio.backend(...))``.
Imports are lazy so that ``teraio --help`` does not pay for importing torch, and importing
``teraio.planner`` loads nothing else of teraio: every name below is loaded when it is first asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "backend",
    "default_backend",
    "process_stats",
    "warm_up_mkl_vml",
    "TeraioBackend",
    "BackendConfig",
    "States",
    "Solver",
    "Profiling",
    "__version__",
]

if TYPE_CHECKING:
    from teraio.config import BackendConfig, IOBackendName, OnPlanMismatch, Profiling, Solver, TierName
    from teraio.graph.compilers import InnerCompiler
    from teraio.lifecycle.backend import TeraioBackend, default_backend
    from teraio.states.config import States

#: The default tiers, by identity: left at its default, ``tiers`` is not passed on (BackendConfig's own).
_DEFAULT_TIERS = ("ssd",)


def backend(
    *,
    memory_budget: str | int | float | None = None,
    offload_dirs: Sequence[str] | str | dict[int, Sequence[str] | str] | None = None,
    tiers: Sequence[TierName] = _DEFAULT_TIERS,
    io_backend: IOBackendName | None = None,
    checksum: bool = True,
    states: States | None = None,
    solver: Solver | str = "ilp",
    profiling: Profiling | None = None,
    inner: InnerCompiler = "inductor",
    enabled: bool = True,
    plan: str | None = None,
    on_plan_mismatch: OnPlanMismatch = "error",
    hardware: str | None = None,
    run_dir: str | None = None,
    runtime_options: dict[str, Any] | None = None,
    **deprecated: Any,
) -> TeraioBackend:
    """A configured backend: ``torch.compile(model, backend=teraio.backend(memory_budget="50%"))``.

    docs/options.md has every option in one table per object.

    Args:
        memory_budget: the step's memory budget: bytes or a size ("512MiB"), a percentage or fraction of
            the unplanned peak ("50%", 0.5), "auto"; None: profile and run unplanned, no offload.
        offload_dirs: directories, one per SSD (``{local_rank}``/``{rank}`` placeholders allowed), or a
            mapping from local rank to its directories; None: the runtime's default.
        tiers: where offloaded tensors may go: "ssd", "host" (host memory), or both.
        io_backend: "posix", "kvikio", "host" or "auto"; None: ``TERAIO_IO_BACKEND`` or auto.
        checksum: verify every fetched chunk (crc32c).
        states: ``teraio.States(optimizer=opt, ...)``: the optimizer's gradients and states (and
            parameters) on disk, its step streamed; None: they stay in memory.
        solver: ``teraio.Solver(...)``, or a solver's name for ``Solver(name=...)``.
        profiling: ``teraio.Profiling(...)``: how graphs are measured before they are planned; None:
            ``teraio.Profiling()``, the defaults.
        inner: the compiler of the rewritten graphs: "inductor" or "eager" (FX only).
        enabled: False profiles only and never offloads.
        plan: a plan file or directory (``teraio plan``) to use instead of planning.
        on_plan_mismatch: when ``plan`` was made for another graph: "error" or "reprofile".
        hardware: a HardwareModel JSON, "calibrate" (measure the offload directory), or None (built in).
        run_dir: where the run is recorded (config.json, stats.jsonl, graphN/); None: nowhere.
        runtime_options: extra RuntimeConfig fields for the engines (tests).
        **deprecated: the flat options of earlier releases (``profile_steps=``, ``optimizer=``, ...), for
            this release only: each is folded into its object with a ``DeprecationWarning``.

    Raises:
        UserInputError: an option is refused (one line naming it and what to write instead).
        TypeError: an option teraio does not know.
    """
    from teraio.config import make_config
    from teraio.lifecycle.backend import TeraioBackend

    given: dict[str, Any] = {
        "memory_budget": memory_budget,
        "offload_dirs": offload_dirs,
        "io_backend": io_backend,
        "checksum": checksum,
        "states": states,
        "solver": solver,
        "inner": inner,
        "enabled": enabled,
        "plan": plan,
        "on_plan_mismatch": on_plan_mismatch,
        "hardware": hardware,
        "run_dir": run_dir,
        "runtime_options": {} if runtime_options is None else runtime_options,
    }
    if tiers is not _DEFAULT_TIERS:
        given["tiers"] = tiers
    if profiling is not None:  # None: the defaults, which deprecated flat names may still fill
        given["profiling"] = profiling
    return TeraioBackend(make_config(**given, **deprecated))


def process_stats() -> list[dict[str, Any]]:
    """Every live backend of this process, what it holds and did (``teraio.lifecycle.registry.process_stats``)."""
    from teraio.lifecycle.registry import process_stats as stats

    return stats()


def warm_up_mkl_vml() -> tuple[tuple[str, str], ...]:
    """Run each unary op ATen may hand to MKL VML once on one element, on this thread, so that no
    later concurrent first call can pick a low-accuracy kernel (Note: [MKL VML's first concurrent call]
    in teraio.platform.mkl_vml). Constructing a backend does it; a reference loop without teraio can call it."""
    from teraio.platform.mkl_vml import warm_up_mkl_vml as warm

    return warm()


def __getattr__(name: str) -> Any:
    # The lifecycle module and the states' config import torch (or soon will): load them only when asked.
    if name in ("default_backend", "TeraioBackend"):
        import teraio.lifecycle.backend as lifecycle

        return getattr(lifecycle, name)
    if name in ("BackendConfig", "Solver", "Profiling"):
        import teraio.config as config

        return getattr(config, name)
    if name == "States":
        from teraio.states.config import States

        return States
    raise AttributeError(f"module 'teraio' has no attribute {name!r}")

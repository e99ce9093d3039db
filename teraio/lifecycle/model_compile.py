"""``backend.compile(model)``: one call compiles a model for offload, each repeated block on its own and
the rest of the model (embeddings, final norm, head) as graphs of their own.

Parameters move only when a compiled graph takes them as inputs (Note: [When a parameter is resident] in
teraio.states.params), and one block's weights at a time only when each block is its own graph. Compiling
the whole model as one graph holds every weight while it runs; compiling the blocks by hand
(``for block in model.blocks: block.compile(...)``) leaves the embeddings and the head eager, resident for
good (for Llama-3-70B, 2.1 billion parameters). This module finds the block list, compiles each block in
place, and compiles what holds parameters outside it, so that every parameter can move.

Note: [Which modules become graphs]
    The block list is the ``nn.ModuleList`` or ``nn.Sequential`` with the most parameters whose children,
    at least two, are all of one class (HF's ``model.model.layers``, GPT-2's ``transformer.h``, the
    built-in GPT's ``blocks``); a list nested in a block (a mixture of experts) holds fewer parameters
    than the list of blocks around it. Each block is compiled in place (``block.compile``): Dynamo traces
    one graph that every block of the class calls with its own weights as inputs. The rest is walked from
    the root: a module that contains the block list runs eagerly (its forward is the loop over the
    blocks) and its children are visited; a module that contains no block and holds parameters becomes a
    graph of its own, the largest such (an ``Embedding``, a final norm, a head). Modules without
    parameters (a rotary embedding's cached tables, a dropout) stay eager: they have nothing to move, and
    a graph of their own would only add a call. The parameters a module on the way to the block list owns
    itself are used by its eager forward and stay resident (logged). Tied weights (HF's embedding and
    head) are one parameter that two graphs take: each graph's call fetches it (Note: [When a parameter
    is resident] in teraio.states.params counts the holds), and no eager module uses it.

    Compiling in place (``Module.compile``) keeps the model object: the user keeps calling ``model(...)``,
    and HF's ``Trainer`` and ``state_dict`` keys (no ``_orig_mod.`` prefix) see the model unchanged.

Note: [A torch.nn module needs a frame Dynamo traces]
    ``Module.compile`` compiles the module's ``_call_impl``, whose frame is in torch's own files, which
    Dynamo does not start tracing in; it starts in the first frame outside them, the module's
    ``forward`` for a model's own class (a block, HF's ``LlamaRMSNorm``). A ``torch.nn`` class's
    ``forward`` (``Embedding``, ``Linear``, ``LayerNorm``, ``Sequential``) is in torch's files too, so
    ``Module.compile`` on it compiled nothing: the module ran eagerly and its weights stayed resident
    (measured: no graph at all for an ``nn.Linear`` or an ``nn.Sequential`` of torch layers). Such a
    module is compiled through a one-line function of this module that calls its ``_call_impl``, the
    frame ``torch.compile(module)`` adds for the same reason (``OptimizedModule._initialize``). Each
    module gets a wrapper with a code object of its own: Dynamo keeps its cache and counts its recompile
    limit (``torch._dynamo.config.recompile_limit``, 8) per code object, and wrappers that shared one
    counted every module's class and shape in the process against those 8 (a model's token and position
    embeddings are two; a second model, or a test suite, adds more). Past it Dynamo ran the module
    eagerly: with its parameters on disk, a read of a released weight ("setStorage: ... storage of size
    0"; seen in a test worker that had compiled other models first).

Note: [A wrapped entry opens the gate itself]
    Parameters on disk are guarded while no module of the model runs (Note: [Parameters are guarded while
    no module of the model runs] in teraio.states.entry_gate): the gate opens in the forward hooks
    ``Module._call_impl`` runs before Dynamo enters a module's ``forward``. A ``torch.nn`` class compiled
    through the one-line function of Note: [A torch.nn module needs a frame Dynamo traces] is entered
    at that function's frame instead, with its ``_call_impl`` and hooks traced inside the graph, so each
    compiled module's ``_compiled_call_impl`` becomes a plain function (Dynamo never sees it:
    ``Module.__call__`` calls it eagerly) that opens the gate around the compiled call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from teraio.errors import UserInputError

if TYPE_CHECKING:
    from teraio.lifecycle.backend import TeraioBackend

log = logging.getLogger("teraio")

#: The attribute that marks a module compiled by ``backend.compile``: the backend's id.
_MARK = "_teraio_compiled_by"


@dataclass
class CompilePlan:
    """What :func:`compile_model` compiles: the block list's name and blocks, the other modules."""

    blocks_name: str | None
    blocks: list[nn.Module] = field(default_factory=list)
    #: The largest parameter-holding modules outside the block list, by qualified name.
    others: dict[str, nn.Module] = field(default_factory=dict)
    #: Parameters owned by modules that contain the block list (used by their eager forward).
    eager_params: dict[str, nn.Parameter] = field(default_factory=dict)
    #: Why no block list was found (None: one was).
    why_whole: str | None = None


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_list(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The model's block list (Note: [Which modules become graphs]): its qualified name and the module,
    or None when no list of at least two children of one class holds parameters."""
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        count = _param_count(module)
        if count > 0 and (best is None or count > best[0]):
            best = (count, name, module)
    return None if best is None else (best[1], best[2])


def plan_compile(model: nn.Module) -> CompilePlan:
    """Which modules :func:`compile_model` compiles (Note: [Which modules become graphs])."""
    found = find_block_list(model)
    if found is None:
        return CompilePlan(
            blocks_name=None,
            why_whole="no nn.ModuleList or nn.Sequential of at least 2 blocks of one class holds parameters",
        )
    blocks_name, block_list = found
    plan = CompilePlan(blocks_name=blocks_name, blocks=list(block_list.children()))
    holders = {id(m) for m in model.modules() if any(c is block_list for c in m.modules())}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, p in module.named_parameters(recurse=False):
            plan.eager_params[f"{prefix}{name}"] = p
        for name, child in module.named_children():
            if child is block_list:
                continue
            if id(child) in holders:
                visit(f"{prefix}{name}.", child)
            elif _param_count(child) > 0:
                plan.others[f"{prefix}{name}"] = child

    visit("", model)
    return plan


def _traced_entry(call: Any) -> Any:
    """Note: [A torch.nn module needs a frame Dynamo traces]: a frame of its own for ``call``, with a code
    object of its own."""

    def traced_entry(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    traced_entry.__code__ = traced_entry.__code__.replace()  # a new code object: its own Dynamo cache
    return traced_entry


def _forward_in_torch(module: nn.Module) -> bool:
    return getattr(type(module).forward, "__module__", "").startswith("torch.")


def compile_in_place(module: nn.Module, backend: Any, compile_kwargs: dict[str, Any]) -> None:
    """``module.compile(backend=backend, **compile_kwargs)``, through a frame Dynamo traces for a
    ``torch.nn`` class (Note: [A torch.nn module needs a frame Dynamo traces]), entered through a call
    that opens the gate of parameters on disk around it (Note: [A wrapped entry opens the gate
    itself])."""
    if _forward_in_torch(module):
        module._compiled_call_impl = torch.compile(
            _traced_entry(module._call_impl), backend=backend, **compile_kwargs
        )
    else:
        module.compile(backend=backend, **compile_kwargs)
    module._compiled_call_impl = _gated_entry(module._compiled_call_impl, backend)


def _gated_entry(compiled: Any, backend: Any) -> Any:
    """Note: [A wrapped entry opens the gate itself]: a plain function that opens the gate of the
    backend's parameters on disk (if any) around the compiled module's call."""
    residency = getattr(getattr(backend, "states", None), "residency", None)
    gate = getattr(residency, "gate", None)
    if gate is None:
        return compiled

    def gated_entry(*args: Any, **kwargs: Any) -> Any:
        gate.enter()
        try:
            return compiled(*args, **kwargs)
        finally:
            gate.exit()

    return gated_entry


def check_compilable(model: Any, backend_id: int) -> None:
    """One line when ``model`` cannot be compiled by ``backend.compile``: not a module, the result of
    ``torch.compile``, or a module (or one of its submodules) compiled already.

    Raises:
        UserInputError: what is wrong and what to do.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise UserInputError(
            "backend.compile(model): the model is already the result of torch.compile; pass the model "
            "itself (backend.compile compiles it in place)"
        )
    if not isinstance(model, nn.Module):
        raise UserInputError(
            f"backend.compile(model) takes a torch.nn.Module, not {type(model).__name__}; for a function, "
            "use torch.compile(fn, backend=backend)"
        )
    for name, module in model.named_modules():
        if getattr(module, _MARK, None) == backend_id:
            raise UserInputError(
                f"backend.compile: {type(model).__name__} was compiled by this backend already (it is "
                "compiled in place: keep calling the model; call backend.compile once per model)"
            )
        if getattr(module, "_compiled_call_impl", None) is not None:
            where = f"its submodule {name!r}" if name else "it"
            raise UserInputError(
                f"backend.compile: {type(model).__name__} is compiled already ({where}, by "
                "Module.compile or another backend); build the model afresh and call backend.compile "
                "on it alone"
            )


def compile_model(backend: TeraioBackend, model: nn.Module, /, **compile_kwargs: Any) -> nn.Module:
    """Compile ``model`` in place for offload (Note: [Which modules become graphs]) and return it.

    Args:
        backend: the teraio backend the graphs are compiled with.
        model: the model; its blocks and other parameter-holding modules are compiled in place.
        compile_kwargs: passed to ``torch.compile`` (``dynamic``, ``mode``, ``options``, ``fullgraph``).

    Returns:
        ``model`` itself, compiled in place.

    Raises:
        UserInputError: ``model`` is not a module, or is compiled already; ``compile_kwargs`` names a
            backend.
    """
    if "backend" in compile_kwargs:
        raise UserInputError(
            "backend.compile(model, backend=...): the backend is the one compile is called on; drop the "
            "backend argument"
        )
    check_compilable(model, backend.backend_id)
    plan = plan_compile(model)
    if plan.why_whole is not None:
        compile_in_place(model, backend, compile_kwargs)
        setattr(model, _MARK, backend.backend_id)
        log.info(
            "backend.compile: %s compiled as one graph: %s (every weight is in memory while it runs)",
            type(model).__name__,
            plan.why_whole,
        )
        return model
    for module in [*plan.blocks, *plan.others.values()]:
        compile_in_place(module, backend, compile_kwargs)
    for module in [model, *plan.blocks, *plan.others.values()]:
        setattr(module, _MARK, backend.backend_id)
    log.info(
        "backend.compile: %s: %d blocks of %s (%s) and %d other module(s) (%s) compiled in place, "
        "%d graphs a forward%s",
        type(model).__name__,
        len(plan.blocks),
        type(plan.blocks[0]).__name__,
        plan.blocks_name,
        len(plan.others),
        ", ".join(plan.others) or "none",
        len(plan.blocks) + len(plan.others),
        (
            f"; {', '.join(plan.eager_params)} stay(s) in memory (used by an eager forward)"
            if plan.eager_params
            else ""
        ),
    )
    return model


__all__ = [
    "CompilePlan",
    "check_compilable",
    "compile_in_place",
    "compile_model",
    "find_block_list",
    "plan_compile",
]

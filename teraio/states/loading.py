"""A model's parameters and buffers loaded from safetensors files straight to their place, one tensor at a
time: to disk for the parameters the states offload, into memory for the others. ``load_pretrained`` and
``load_checkpoint`` (teraio.states.checkpoint) both load through here.

Note: [A model is loaded one tensor at a time]
    The user builds the model on the meta device (no bytes), makes the optimizer and the backend as usual,
    then loads. Every file's header is read and the whole load is checked first (names, missing and
    unexpected keys, shapes, dtypes, file sizes): the first problem is one line, before any byte is
    allocated or written. Then each parameter in turn gets real memory, is read into it with ``pread``
    (Note: [Tensors are read with pread, not mapped] in teraio.states.safetensors_files), and, when the
    states offload it, is written to its slot on disk while the next one is read, and freed once
    written: the load's resident memory is two tensors plus the parameters that stay in memory, whatever
    the model's size.

Note: [A load reads ahead and leaves no page cache behind]
    Reading a tensor with ``pread`` goes through the page cache, and a tensor is read once: while one
    is read the kernel is asked to read the next one's bytes ahead (``POSIX_FADV_WILLNEED``), and once
    one is read its cached pages are dropped (``POSIX_FADV_DONTNEED``), so a load of a file larger than
    memory does not fill memory with the file's pages.

Note: [A loaded parameter keeps its object]
    The model, the optimizer and teraio's own hooks hold each parameter by object, so a parameter built on
    the meta device must become a real one without becoming another object (``from_pretrained`` and
    ``to_empty`` make new ones, which an optimizer made before would not see). ``torch.utils.swap_tensors``
    gives the object a real tensor's contents; its Python attributes are kept. Tensor hooks registered on
    the meta parameter (teraio's gradient hooks among them) stay in the object's dictionaries but their
    registration with autograd does not follow the swap, so the dictionaries are registered again.

Note: [Buffers the model computes]
    Persistent buffers (a norm's running statistics) are in the files and loaded like parameters.
    Non-persistent ones (rotary frequencies, causal masks) are computed by the model's own code and are
    not in any file. Built under ``accelerate.init_empty_weights()`` (parameters on meta, buffers real),
    they are already right. Built under ``torch.device("meta")`` they are on meta too: for a Hugging Face
    model they are computed as ``from_pretrained`` computes them, by the model's ``initialize_weights()``
    with every parameter and loaded buffer flagged as initialised, so that nothing else is touched and no
    random number is drawn (the parameters are still on meta then: nothing is read or written). Any
    other model with a buffer on meta is refused in one line, since only its own code knows the value.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from teraio.states.errors import CheckpointError
from teraio.states.safetensors_files import Header, crc32c_of, files_of, headers_by_tensor, read_into

if TYPE_CHECKING:
    from teraio.states.params import ParamResidency


@dataclass
class ParamSlot:
    """One parameter object and every name the model gives it (tied weights have several)."""

    param: torch.nn.Parameter
    names: list[str]


@dataclass
class BufferSlot:
    """One persistent buffer object, its names, and the modules that own it."""

    tensor: torch.Tensor
    names: list[str]
    owners: list[tuple[torch.nn.Module, str]]


def model_tensors(model: torch.nn.Module) -> tuple[list[ParamSlot], list[BufferSlot]]:
    """The model's parameters and persistent buffers, each object once with all its names, in the
    model's order."""
    params: dict[int, ParamSlot] = {}
    buffers: dict[int, BufferSlot] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for local, p in module._parameters.items():
            if p is None:
                continue
            slot = params.setdefault(id(p), ParamSlot(p, []))
            if prefix + local not in slot.names:
                slot.names.append(prefix + local)
        for local, b in module._buffers.items():
            if b is None or local in module._non_persistent_buffers_set:
                continue
            bslot = buffers.setdefault(id(b), BufferSlot(b, [], []))
            if prefix + local not in bslot.names:
                bslot.names.append(prefix + local)
                bslot.owners.append((module, local))
    return list(params.values()), list(buffers.values())


@dataclass
class LoadPlan:
    """Where each of the model's tensors comes from (checked: Note: [A model is loaded one tensor at a
    time])."""

    params: list[tuple[ParamSlot, str, Header]]
    buffers: list[tuple[BufferSlot, str, Header]]


@dataclass
class LoadReport:
    """What a load did: tensors and bytes read, bytes written to disk, bytes left in memory, time."""

    tensors: int = 0
    read_bytes: int = 0
    offloaded_bytes: int = 0
    resident_bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "read_bytes": self.read_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "resident_bytes": self.resident_bytes,
            "seconds": self.seconds,
            "files": list(self.files),
        }


def pretrained_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of ``path``: a ``.safetensors`` file, or a Hugging Face model directory (one
    ``model.safetensors``, or shards named by ``model.safetensors.index.json``).

    Raises:
        CheckpointError: ``path`` is missing or neither of those.
    """
    p = Path(path)
    if p.is_dir():
        files = files_of(p, "model")
        if files is None:
            raise CheckpointError(
                f"'{p}' is not a Hugging Face model directory: it has neither model.safetensors nor "
                "model.safetensors.index.json"
            )
        return files
    if p.is_file():
        return [p]
    raise CheckpointError(f"'{p}' does not exist: give a .safetensors file or a Hugging Face model directory")


def ignored_unexpected(model: torch.nn.Module) -> list[re.Pattern[str]]:
    """Names a Hugging Face model declares it may find in its checkpoints and ignore (old layouts)."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(n.endswith("rotary_emb.inv_freq") for n, _ in model.named_buffers()):
        patterns.append(r"rotary_emb\.inv_freq")  # moved out of old checkpoints, as from_pretrained allows
    return [re.compile(p) for p in patterns]


def saved_name(names: list[str], saved: Any, tensor: torch.Tensor, what: str, source: str) -> str:
    """The first of a tensor's ``names`` (tied weights have several) that ``saved`` holds.

    Raises:
        CheckpointError: none of them.
    """
    for n in names:
        if n in saved:
            return n
    raise CheckpointError(
        f"{source} has no tensor for {what} {names[0]!r} {tuple(tensor.shape)}: it is not the checkpoint "
        "of this model (or of this model's configuration)"
    )


def plan_load(model: torch.nn.Module, headers: dict[str, Header], *, source: str) -> LoadPlan:
    """Match every parameter and persistent buffer of ``model`` with a tensor of the files, or raise the
    first mismatch in one line (Note: [A model is loaded one tensor at a time]).

    Raises:
        CheckpointError: a missing or unexpected name, a shape or dtype that differs.
    """
    params, buffers = model_tensors(model)
    used: set[str] = set()
    plan = LoadPlan([], [])

    def pick(names: list[str], tensor: torch.Tensor, what: str) -> tuple[str, Header]:
        name = saved_name(names, headers, tensor, what, source)
        used.update(n for n in names if n in headers)
        header = headers[name]
        entry = header.entries[name]
        if entry.shape != tuple(tensor.shape):
            raise CheckpointError(
                f"{source}: {name!r} has shape {entry.shape} in '{header.path.name}', the model's is "
                f"{tuple(tensor.shape)}"
            )
        if entry.dtype != tensor.dtype:
            raise CheckpointError(
                f"{source}: {name!r} is {entry.dtype} in '{header.path.name}', the model's is "
                f"{tensor.dtype} (teraio loads without casting: build the model in {entry.dtype})"
            )
        return name, header

    for slot in params:
        plan.params.append((slot, *pick(slot.names, slot.param, "parameter")))
    for bslot in buffers:
        plan.buffers.append((bslot, *pick(bslot.names, bslot.tensor, "buffer")))
    ignored = ignored_unexpected(model)
    for name in headers:
        if name not in used and not any(p.search(name) for p in ignored):
            raise CheckpointError(
                f"{source}: '{headers[name].path.name}' holds {name!r}, which the model does not have: it "
                "is not the checkpoint of this model"
            )
    return plan


def materialize(p: torch.Tensor, device: torch.device) -> None:
    """Note: [A loaded parameter keeps its object]."""
    cls = type(p)
    data = torch.empty(p.shape, dtype=p.dtype, device=device)
    new = (
        cls(data, requires_grad=p.requires_grad)
        if cls is torch.nn.Parameter
        else data.requires_grad_(p.requires_grad)
    )
    new.__dict__.update(p.__dict__)
    try:
        torch.utils.swap_tensors(p, new)
    except RuntimeError as exc:
        raise CheckpointError(
            f"cannot give a meta parameter {tuple(p.shape)} its memory without changing its object ({exc}): "
            "load before anything else holds it (torch.compile, a weak reference)"
        ) from None
    for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(p, attr, None)
        if hooks is not None:  # registered with the meta tensor's autograd data: register them again
            setattr(p, attr, None)
            setattr(p, attr, hooks)


def is_hf_model(model: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # never imported for a model that is not one
    pretrained_cls = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return pretrained_cls is not None and isinstance(model, pretrained_cls)


def check_computable_buffers(model: torch.nn.Module) -> None:
    """Refuse, before anything is loaded, a model whose non-persistent buffers are on meta and that cannot
    compute them (Note: [Buffers the model computes])."""
    _, persistent = model_tensors(model)
    loaded = {id(b.tensor) for b in persistent}
    meta = [n for n, b in model.named_buffers() if b.is_meta and id(b) not in loaded]
    if meta and not is_hf_model(model):
        raise CheckpointError(
            f"buffer {meta[0]!r} is on the meta device and in no file (its model computes it): build the model "
            "under accelerate.init_empty_weights() (parameters on meta, buffers computed) instead of "
            "torch.device('meta')"
        )


def init_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Note: [Buffers the model computes]."""
    if not any(b.is_meta for b in model.buffers()):
        return
    check_computable_buffers(model)
    for t in (*model.parameters(), *(b for b in model.buffers() if not b.is_meta)):
        t._is_hf_initialized = True  # type: ignore[attr-defined]
    for module in model.modules():
        for local, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[local] = torch.empty_like(b, device=device)
    model.initialize_weights()  # type: ignore[operator]
    still = [n for n, b in model.named_buffers() if b.is_meta]
    if still:
        raise CheckpointError(
            f"buffer {still[0]!r} is still on the meta device after the model's initialize_weights()"
        )


class OpenFiles:
    """Open descriptors of the files a load reads, closed together."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return self.fds[path]

    def advise(self, header: Header, name: str, advice: int) -> None:
        """Note: [A load reads ahead and leaves no page cache behind]."""
        if hasattr(os, "posix_fadvise"):
            entry = header.entries[name]
            os.posix_fadvise(self.fd(header.path), entry.offset_bytes, entry.nbytes, advice)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _read(
    files: OpenFiles,
    header: Header,
    name: str,
    target: torch.Tensor,
    checksums: dict[str, dict[str, int]] | None,
) -> None:
    entry = header.entries[name]
    direct = target.device.type == "cpu" and target.is_contiguous()
    buf = target if direct else torch.empty(entry.shape, dtype=entry.dtype)
    read_into(files.fd(header.path), entry, buf, path=header.path)
    if hasattr(os, "POSIX_FADV_DONTNEED"):
        files.advise(header, name, os.POSIX_FADV_DONTNEED)
    if checksums is not None:
        want = checksums.get(header.path.name, {}).get(name)
        if want is None or crc32c_of(buf.detach()) != want:
            raise CheckpointError(
                f"'{header.path}': tensor {name!r} does not match its checksum in the manifest (the file "
                "was changed or damaged): the load stopped; rebuild the model and load another checkpoint"
            )
    if not direct:
        with torch.no_grad():
            target.copy_(buf)


def load_model(
    model: torch.nn.Module,
    files: Iterable[Path],
    *,
    residency: ParamResidency | None,
    device: torch.device,
    source: str,
    checksums: dict[str, dict[str, int]] | None = None,
) -> LoadReport:
    """Load ``model``'s parameters and persistent buffers from ``files`` (Note: [A model is loaded one
    tensor at a time]); offloadable parameters go to disk through ``residency``. ``checksums``: the crc32c
    of each tensor by file name and tensor name, verified on read (a teraio checkpoint's manifest)."""
    start = time.perf_counter()
    paths = list(files)
    headers = headers_by_tensor(paths)
    plan = plan_load(model, headers, source=source)
    check_computable_buffers(model)
    report = LoadReport(files=[p.name for p in paths])
    opened = OpenFiles()
    try:
        for bslot, name, header in plan.buffers:
            b = bslot.tensor
            if b.is_meta:
                new = torch.empty(b.shape, dtype=b.dtype, device=device)
                for module, local in bslot.owners:
                    module._buffers[local] = new
                b = new
            _read(opened, header, name, b, checksums)
            report.tensors += 1
            report.read_bytes += header.entries[name].nbytes
            report.resident_bytes += header.entries[name].nbytes
        init_meta_buffers(model, device)
        writing: int | None = None  # the parameter whose write to disk is in flight
        for k, (slot, name, header) in enumerate(plan.params):
            if k + 1 < len(plan.params) and hasattr(os, "POSIX_FADV_WILLNEED"):
                _, next_name, next_header = plan.params[k + 1]
                opened.advise(next_header, next_name, os.POSIX_FADV_WILLNEED)
            p = slot.param
            if p.is_meta:
                materialize(p, device)
            with torch.no_grad():
                _read(opened, header, name, p, checksums)  # while the previous one is written
            if writing is not None and residency is not None:
                residency.finish_offload_loaded(writing)
                writing = None
            nbytes = header.entries[name].nbytes
            report.tensors += 1
            report.read_bytes += nbytes
            idx = None if residency is None else residency.index_of.get(id(p))
            if idx is not None and residency is not None and residency.start_offload_loaded(idx):
                writing = idx
                report.offloaded_bytes += nbytes
            else:
                report.resident_bytes += nbytes
        if writing is not None and residency is not None:
            residency.finish_offload_loaded(writing)
    finally:
        opened.close()
    report.seconds = time.perf_counter() - start
    return report

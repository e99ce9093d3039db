"""Checkpoints of FSDP2 jobs: each rank writes its own shards into the one checkpoint directory, and any
layout reads them back (the same job's, another number of ranks, one process without FSDP2).

Note: [A checkpoint of an FSDP2 job]
    Under FSDP2 each rank holds a shard of every parameter and optimizer state (DTensors: Note: [A sharded
    tensor's bytes are its local shard] in teraio.states.shards). ``save_checkpoint`` is a collective: each
    rank writes its own shards, each under the tensor's name, to ``model.rank0000r.safetensors`` and
    ``optimizer.rank0000r.safetensors`` in the checkpoint directory (split past ``max_shard_size`` like any
    checkpoint's files), one tensor in memory at a time as on one process; what every rank holds alike
    (buffers, a parameter FSDP2 does not shard, an optimizer's ``step``) rank 0 writes once. The manifest
    (format version 2, ``"layout": "sharded"``) records for every tensor its global shape and the *piece*
    of it each file holds: an offset and a shape per dimension, in the global tensor's coordinates.

    Loading assembles each tensor the loading process holds (its local shard under FSDP2, the whole tensor
    without it) from the pieces that overlap it: a piece that is exactly the local shard is read straight
    into it; any other is read whole into a buffer of its own, checked against its crc32c, and the overlap
    copied. Files without checksums (a Hugging Face model directory through ``load_pretrained``) are read
    only where they overlap, when the overlap is whole rows of both (one byte range: FSDP2's ``Shard(0)``),
    so each rank reads its share of the file, not all of it. So the job that saved reads its own files, and a job of another size, one process without
    FSDP2 (the trained model exported, evaluated) or an FSDP2 job resuming a checkpoint of one process
    (version 1, every tensor one whole piece) read the same directory. Sharding is ``Shard(dim)`` and
    ``Replicate()`` placements, on any mesh, as ``fully_shard`` makes them (HSDP's replicas write the same
    pieces; the first is read); the strided shards of FSDP2 composed with tensor parallelism are refused
    in one line.

    The directory is complete or absent as on one process (Note: [A checkpoint is complete or absent] in
    teraio.states.checkpoint): rank 0 creates the private staging directory and sends the others its path,
    every rank writes its files into it and sends back their sizes and checksums, and rank 0 checks that
    every file is there with its size (a rank that does not see rank 0's filesystem is caught here), writes
    ``train_state.json`` and the manifest last and renames the directory. An error on any rank removes the
    staging directory (rank 0 made it) and raises on every rank. Every rank must see the checkpoint
    directory: one machine, or a filesystem the ranks share.

    Parameter shards are loaded into memory, not written to disk on the way as on one process: FSDP2
    re-pads each shard the first time the model runs (``FSDPParam.reset_sharded_param``), reading the
    shard's values; the first step that takes a shard writes it to disk (Note: [When a parameter is
    resident] in teraio.states.params). Parameters are given their memory by the user, as FSDP2 asks
    (``model.to_empty(device=...)`` after ``fully_shard`` on the meta device): a shard still on the meta
    device is refused in one line. Optimizer states go to disk one at a time as on one process.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from teraio.planner.private_dir import PrivateDir
from teraio.states.errors import CheckpointError
from teraio.states.loading import (
    LoadReport,
    OpenFiles,
    check_computable_buffers,
    init_meta_buffers,
    materialize,
    model_tensors,
    saved_name,
)
from teraio.states.optimizer_stream import RESIDENT_STATE_KEYS
from teraio.states.safetensors_files import Header, Planned, crc32c_of, read_header, read_into, write_shards
from teraio.states.shards import is_sharded, local, rewrap, shard_elements
from teraio.states.store import Record

if TYPE_CHECKING:
    from teraio.states.offload import StateOffload

#: The manifest's format version of a checkpoint written rank by rank (version 1: whole tensors).
SHARDED_FORMAT_VERSION = 2
SHARDED_LAYOUT = "sharded"


# -- pieces --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Box:
    """A block of a tensor in its global coordinates: where it starts and its size, per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def overlap(self, other: Box) -> Box | None:
        """The block both hold (None: none, or an empty one)."""
        starts = [max(a, b) for a, b in zip(self.offset, other.offset)]
        ends = [min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape)]
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(tuple(starts), tuple(e - s for s, e in zip(starts, ends)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This block's index in a tensor holding ``outer``."""
        return tuple(slice(s - o, s - o + n) for s, o, n in zip(self.offset, outer.offset, self.shape))

    def as_json(self) -> dict[str, list[int]]:
        return {"offset": list(self.offset), "shape": list(self.shape)}


def whole_box(shape: Iterable[int]) -> Box:
    shape = tuple(int(n) for n in shape)
    return Box((0,) * len(shape), shape)


def box_of(t: torch.Tensor, what: str) -> Box:
    """The block of ``t``'s global tensor this process holds: a DTensor's local shard, else all of it.

    Raises:
        CheckpointError: a placement teraio cannot map to a block (the strided shards of FSDP2 with tensor
            parallelism, partial values).
    """
    if not is_sharded(t):
        return whole_box(t.shape)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = t.placements  # type: ignore[attr-defined]
    if any(type(pl) not in (Shard, Replicate) for pl in placements):
        raise CheckpointError(
            f"{what} is sharded as {tuple(placements)}: teraio's checkpoints take Shard(dim) and Replicate() "
            "placements (fully_shard's); save it with torch.distributed.checkpoint"
        )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)  # type: ignore[attr-defined]
    if tuple(shape) != tuple(local(t).shape):
        raise CheckpointError(
            f"{what}: its local shard is {tuple(local(t).shape)}, its placements say {tuple(shape)}; teraio "
            "cannot tell which block of the tensor it holds"
        )
    return Box(tuple(offset), tuple(shape))


@dataclass(frozen=True)
class Piece:
    """A block of a saved tensor, and where its bytes are."""

    box: Box
    header: Header


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of a checkpoint: its global shape, dtype, and the pieces that hold it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]


class SavedPieces:
    """Every tensor of a checkpoint's files by name, as pieces of the global tensor (a whole checkpoint's
    tensors are one piece each)."""

    def __init__(self, tensors: dict[str, SavedTensor]) -> None:
        self.tensors = tensors

    @classmethod
    def from_whole_files(cls, files: Iterable[Path]) -> SavedPieces:
        """Files of whole tensors (a version-1 checkpoint, a Hugging Face model directory)."""
        tensors: dict[str, SavedTensor] = {}
        for path in files:
            header = read_header(path)
            for name, entry in header.entries.items():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} is in '{path}' and in another file too")
                tensors[name] = SavedTensor(entry.shape, entry.dtype, [Piece(whole_box(entry.shape), header)])
        return cls(tensors)

    @classmethod
    def from_manifest(cls, directory: Path, manifest: dict[str, Any], kind: str) -> SavedPieces:
        """The pieces of ``kind`` ("model", "optimizer") a version-2 manifest lists, each checked against
        its file's header."""
        headers: dict[str, Header] = {}
        tensors: dict[str, SavedTensor] = {}
        for name, saved in manifest["pieces"][kind].items():
            pieces = []
            dtype = None
            shape = tuple(int(n) for n in saved["shape"])
            for entry in saved["pieces"]:
                fname = entry["file"]
                if not isinstance(fname, str) or "/" in fname or fname in ("", ".", ".."):
                    raise CheckpointError(f"'{directory}': the manifest names a file outside it: {fname!r}")
                if fname not in headers:
                    headers[fname] = read_header(directory / fname)
                header = headers[fname]
                box = Box(tuple(int(n) for n in entry["offset"]), tuple(int(n) for n in entry["shape"]))
                te = header.entries.get(name)
                if te is None or te.shape != box.shape or len(box.shape) != len(shape):
                    raise CheckpointError(
                        f"'{directory / fname}' does not hold {name!r} as the manifest says: the checkpoint is "
                        "damaged"
                    )
                if any(o < 0 or o + n > g for o, n, g in zip(box.offset, box.shape, shape)):
                    raise CheckpointError(f"'{directory}': a piece of {name!r} lies outside it")
                dtype = te.dtype
                pieces.append(Piece(box, header))
            if dtype is None:
                raise CheckpointError(f"'{directory}': the manifest lists no piece of {name!r}")
            tensors[name] = SavedTensor(shape, dtype, _distinct(pieces))
            _check_covered(name, tensors[name], directory)
        return cls(tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


def _distinct(pieces: list[Piece]) -> list[Piece]:
    """One piece per block: HSDP's replicas write the same block (Note: [A checkpoint of an FSDP2 job])."""
    seen: dict[Box, Piece] = {}
    for p in pieces:
        seen.setdefault(p.box, p)
    return list(seen.values())


def _rows_of(part: Box, outer: Box) -> bool:
    """Whether ``part`` is whole rows of ``outer`` (every dimension but the first complete): one byte range
    of a row-major tensor holding ``outer``."""
    return len(outer.shape) > 0 and part.shape[1:] == outer.shape[1:]


def _check_covered(name: str, saved: SavedTensor, directory: Path) -> None:
    """Distinct pieces of a Shard/Replicate layout do not overlap, so they cover the tensor exactly when
    their sizes add up to its size."""
    if sum(p.box.numel for p in saved.pieces) != math.prod(saved.shape):
        raise CheckpointError(
            f"'{directory}': the pieces of {name!r} do not make up its shape {saved.shape}: the checkpoint is "
            "damaged"
        )


class _PieceReader:
    """Reads pieces into the blocks that need them, checking each piece's crc32c."""

    def __init__(self, checksums: dict[str, dict[str, int]] | None) -> None:
        self.files = OpenFiles()
        self.checksums = checksums
        self.read_bytes = 0

    def _read_piece(self, name: str, piece: Piece, out: torch.Tensor) -> None:
        entry = piece.header.entries[name]
        read_into(self.files.fd(piece.header.path), entry, out, path=piece.header.path)
        self.read_bytes += entry.nbytes
        if hasattr(os, "POSIX_FADV_DONTNEED"):
            self.files.advise(piece.header, name, os.POSIX_FADV_DONTNEED)
        if self.checksums is not None:
            want = self.checksums.get(piece.header.path.name, {}).get(name)
            if want is None or crc32c_of(out) != want:
                raise CheckpointError(
                    f"'{piece.header.path}': tensor {name!r} does not match its checksum in the manifest (the "
                    "file was changed or damaged): the load stopped; rebuild the model and load another "
                    "checkpoint"
                )

    def _read_rows(self, name: str, piece: Piece, part: Box, out: torch.Tensor) -> None:
        """Read the rows ``part`` of ``piece`` (whole rows: one byte range of it) into ``out``."""
        entry = piece.header.entries[name]
        row_bytes = entry.nbytes // entry.shape[0]
        first = part.offset[0] - piece.box.offset[0]
        rows = replace(
            entry,
            offset_bytes=entry.offset_bytes + first * row_bytes,
            shape=part.shape,
            nbytes=part.shape[0] * row_bytes,
        )
        read_into(self.files.fd(piece.header.path), rows, out, path=piece.header.path)
        self.read_bytes += rows.nbytes

    def assemble(self, name: str, saved: SavedTensor, box: Box, target: torch.Tensor) -> None:
        """Fill ``target`` (the block ``box`` of tensor ``name``) from the pieces that overlap it."""
        direct = target.device.type == "cpu" and target.is_contiguous()
        for piece in saved.pieces:
            part = box.overlap(piece.box) if box.numel else None
            if part is None:
                continue
            if piece.box == box and direct:
                self._read_piece(name, piece, target)
                continue
            if direct and self.checksums is None and _rows_of(part, piece.box) and _rows_of(part, box):
                self._read_rows(name, piece, part, target[part.within(box)])
                continue
            buf = torch.empty(piece.box.shape, dtype=saved.dtype)
            self._read_piece(name, piece, buf)
            with torch.no_grad():
                target[part.within(box)].copy_(buf[part.within(piece.box)])
            del buf

    def close(self) -> None:
        self.files.close()


# -- loading -------------------------------------------------------------------------------------------
def _check_tensor(name: str, saved: SavedTensor, t: torch.Tensor, source: str) -> None:
    if saved.shape != tuple(t.shape):
        raise CheckpointError(
            f"{source}: {name!r} has shape {saved.shape} there, the model's is {tuple(t.shape)}"
        )
    if saved.dtype != t.dtype:
        raise CheckpointError(
            f"{source}: {name!r} is {saved.dtype} there, the model's is {t.dtype} (teraio loads without "
            f"casting: build the model in {saved.dtype})"
        )


def load_model_pieces(
    model: torch.nn.Module,
    saved: SavedPieces,
    *,
    residency: Any,
    device: torch.device,
    source: str,
    checksums: dict[str, dict[str, int]] | None,
    ignored: Callable[[str], bool] = lambda name: False,
) -> LoadReport:
    """Load ``model``'s parameters and persistent buffers from ``saved``'s pieces, each process its own
    block of each (Note: [A checkpoint of an FSDP2 job]); every name, shape and dtype is checked first.
    Parameters FSDP2 does not shard go to disk through ``residency`` as on one process (Note: [A model is
    loaded one tensor at a time] in teraio.states.loading).

    Raises:
        CheckpointError: one line naming the first missing, unexpected or mismatched tensor, or a shard on
            the meta device, before any byte is read.
    """
    start = time.perf_counter()
    params, buffers = model_tensors(model)
    used: set[str] = set()
    plan: list[tuple[str, torch.Tensor, Box, Any]] = []
    for slot_names, t, what, slot in [(s.names, s.param, "parameter", s) for s in params] + [
        (b.names, b.tensor, "buffer", b) for b in buffers
    ]:
        name = saved_name(slot_names, saved, t, what, source)
        used.update(n for n in slot_names if n in saved)
        _check_tensor(name, saved.tensors[name], t, source)
        if is_sharded(t) and local(t).is_meta:
            raise CheckpointError(
                f"{what} {name!r} is an FSDP2 shard on the meta device: give the sharded model its memory "
                "first (model.to_empty(device=...) after fully_shard), then load"
            )
        plan.append((name, t, box_of(t, f"{what} {name!r}"), slot))
    for name in saved.tensors:
        if name not in used and not ignored(name):
            raise CheckpointError(
                f"{source} holds {name!r}, which the model does not have: it is not the checkpoint of this model"
            )
    check_computable_buffers(model)
    reader = _PieceReader(checksums)
    report = LoadReport(files=sorted({p.header.path.name for s in saved.tensors.values() for p in s.pieces}))
    buffer_ids = {id(b.tensor) for b in buffers}
    try:
        for name, t, box, slot in plan:  # buffers first: a Hugging Face model computes the others from them
            if id(t) not in buffer_ids:
                continue
            if t.is_meta:
                new = torch.empty(t.shape, dtype=t.dtype, device=device)
                for module, attr in slot.owners:
                    module._buffers[attr] = new
                t = new
            reader.assemble(name, saved.tensors[name], box, local(t))
            report.tensors += 1
            report.resident_bytes += box.numel * t.element_size()
        init_meta_buffers(model, device)
        for name, t, box, _slot in plan:
            if id(t) in buffer_ids:
                continue
            if t.is_meta:
                materialize(t, device)
            with torch.no_grad():
                reader.assemble(name, saved.tensors[name], box, local(t))
            nbytes = box.numel * t.element_size()
            report.tensors += 1
            idx = None if residency is None or is_sharded(t) else residency.index_of.get(id(t))
            if idx is not None and residency.start_offload_loaded(idx):
                residency.finish_offload_loaded(idx)
                report.offloaded_bytes += nbytes
            else:  # a shard stays until its first step (Note: [A checkpoint of an FSDP2 job])
                report.resident_bytes += nbytes
    finally:
        reader.close()
    report.read_bytes = reader.read_bytes
    report.seconds = time.perf_counter() - start
    return report


def state_box(p: torch.Tensor, key: str, saved: SavedTensor, what: str) -> tuple[Box, bool]:
    """The block of a saved optimizer state this process loads, and whether it becomes a DTensor like its
    parameter ``p``: a state shaped like a sharded parameter is sharded like it (AdamW's moments), any
    other (``step``) is whole."""
    if is_sharded(p) and key not in RESIDENT_STATE_KEYS:
        if saved.shape != tuple(p.shape):
            raise CheckpointError(
                f"{what} has shape {saved.shape}, its FSDP2 parameter {tuple(p.shape)}: teraio shards a state "
                "like its parameter; save this optimizer with torch.distributed.checkpoint"
            )
        return box_of(p, what), True
    return whole_box(saved.shape), False


def state_boxes(
    offload: StateOffload, wanted: list[tuple[int, str, str]], saved: SavedPieces
) -> list[tuple[Box, bool]]:
    """:func:`state_box` of each state ``(param index, key, saved name)`` of ``wanted`` (checked before
    any byte moves)."""
    return [
        state_box(offload.params[idx], k, saved.tensors[tname], f"optimizer state {tname!r}")
        for idx, k, tname in wanted
    ]


def load_state_pieces(
    offload: StateOffload,
    wanted: list[tuple[int, str, str]],
    boxes: list[tuple[Box, bool]],
    saved: SavedPieces,
    checksums: dict[str, dict[str, int]] | None,
    device: torch.device,
) -> int:
    """Each state tensor ``(param index, key, saved name)`` of ``wanted`` assembled into its own memory
    (its block and sharding from :func:`state_boxes`) and, unless it stays resident (``step``), written
    to disk and freed before the next (as on one process: teraio.states.checkpoint). Returns the bytes
    loaded."""
    opt = offload.optimizer
    reader = _PieceReader(checksums)
    total = 0
    try:
        for (idx, k, tname), (box, sharded) in zip(wanted, boxes):
            st = saved.tensors[tname]
            buf = torch.empty(box.shape, dtype=st.dtype)
            reader.assemble(tname, st, box, buf)
            total += buf.numel() * buf.element_size()
            t = buf if device.type == "cpu" or k in RESIDENT_STATE_KEYS else buf.to(device)
            p = offload.params[idx]
            value = rewrap(p, t) if sharded else t
            opt.state.setdefault(p, {})[k] = value
            if k not in RESIDENT_STATE_KEYS:
                offload.stream.write_loaded(idx, k, value)
            del buf, t, value
    finally:
        reader.close()
    return total


# -- saving --------------------------------------------------------------------------------------------
def rank_stem(kind: str, rank: int) -> str:
    """The file stem of one rank's ``kind`` ("model", "optimizer") tensors."""
    return f"{kind}.rank{rank:05d}"


@dataclass
class RankItem:
    """One tensor a rank writes: what, its source (a record on disk or a tensor in memory), its block."""

    planned: Planned
    source: Record | torch.Tensor
    box: Box
    global_shape: tuple[int, ...]


def rank_items(named: list[tuple[str, torch.Tensor, Record | None]], rank: int) -> list[RankItem]:
    """The tensors this rank writes of ``named`` ``(name, tensor, its record or None)``: its own block of
    each sharded one; every whole one on rank 0 alone (every rank holds the same)."""
    out = []
    for name, t, rec in named:
        if not is_sharded(t) and rank != 0:
            continue
        box = box_of(t, repr(name))
        planned = Planned(name, t.dtype, box.shape)
        out.append(RankItem(planned, rec if rec is not None else t, box, tuple(t.shape)))
    return out


def fetch_local(offload: StateOffload, source: Record | torch.Tensor) -> torch.Tensor:
    """This rank's elements of a tensor to save: read back from disk (a copy), or its memory."""
    if isinstance(source, torch.Tensor):
        return local(source).detach()
    copy = offload.store.read_copy(source).detach()
    if source.holder is not None and source.tensor is not local(source.holder):
        # A parameter shard's record holds its padded storage (Note: [A parameter shard moves with its
        # padding] in teraio.states.fsdp_shards)
        copy = shard_elements(source.holder, copy)
    return copy.contiguous()


def write_rank_files(
    offload: StateOffload,
    d: PrivateDir,
    rank: int,
    model_items: list[RankItem],
    opt_items: list[RankItem],
    max_shard_bytes: int,
) -> dict[str, Any]:
    """Write this rank's files into the staging directory ``d``; what rank 0 needs for the manifest."""
    result: dict[str, Any] = {
        "sums": {},
        "files": {},
        "pieces": {"model": {}, "optimizer": {}},
        "model_files": [],
        "optimizer_files": [],
    }
    for kind, items in (("model", model_items), ("optimizer", opt_items)):
        by_name = {id(it.planned): it for it in items}

        def fetch(pl: Planned, by_name: dict[int, RankItem] = by_name) -> torch.Tensor:
            return fetch_local(offload, by_name[id(pl)].source)

        def prefetch(pl: Planned, by_name: dict[int, RankItem] = by_name) -> None:
            src = by_name[id(pl)].source
            if isinstance(src, Record) and src.saved_key is not None and src.disk_key == src.saved_key:
                offload.engine.prefetch(src.saved_key)

        sums = write_shards(
            d.open_new,
            rank_stem(kind, rank),
            [it.planned for it in items],
            fetch,
            max_shard_bytes=max_shard_bytes,
            metadata={"format": "pt"} if kind == "model" else None,
            prefetch=prefetch,
        )
        result["sums"].update(sums)
        result[f"{kind}_files"] = list(sums)
        file_of = {n: f for f, names in sums.items() for n in names}
        for it in items:
            result["pieces"][kind][it.planned.name] = {
                "shape": list(it.global_shape),
                "piece": {"file": file_of[it.planned.name], **it.box.as_json()},
            }
    names = os.listdir(d.fd)
    mine = {n for n in names if n.startswith((rank_stem("model", rank), rank_stem("optimizer", rank)))}
    result["files"] = {n: os.stat(n, dir_fd=d.fd).st_size for n in mine}
    return result


def merge_rank_results(results: list[dict[str, Any]], d: PrivateDir) -> dict[str, Any]:
    """The manifest's file, checksum and piece entries from every rank's result, each rank's files checked
    to be in rank 0's staging directory with their sizes (a rank writing elsewhere is caught here)."""
    merged: dict[str, Any] = {"model_files": [], "optimizer_files": [], "file_bytes": {}, "crc32c": {}}
    pieces: dict[str, dict[str, dict[str, Any]]] = {"model": {}, "optimizer": {}}
    for rank, res in enumerate(results):
        for fname, size in res["files"].items():
            try:
                here = os.stat(fname, dir_fd=d.fd, follow_symlinks=False).st_size
            except FileNotFoundError:
                here = None
            if here != size:
                raise CheckpointError(
                    f"rank {rank}'s file '{fname}' is not in '{d.path}' as it wrote it: every rank must see the "
                    "checkpoint directory (one machine, or a shared filesystem)"
                )
        merged["file_bytes"].update(res["files"])
        merged["crc32c"].update(res["sums"])
        merged["model_files"] += res["model_files"]
        merged["optimizer_files"] += res["optimizer_files"]
        for kind, entries in res["pieces"].items():
            for name, entry in entries.items():
                slot = pieces[kind].setdefault(name, {"shape": entry["shape"], "pieces": []})
                slot["pieces"].append(entry["piece"])
    merged["pieces"] = pieces
    return merged

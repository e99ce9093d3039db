"""safetensors files read and written one tensor at a time: the format of teraio's checkpoints and of the
pretrained weights it loads, without ever holding a whole file in memory.

Note: [A safetensors file is written as a stream]
    A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
    shape and byte range, then the tensors' bytes back to back. The stock writer (``save_file``) needs every
    tensor in memory, because it builds the header from them. But the header needs only names, dtypes and
    shapes, which teraio knows for every offloaded tensor without reading a byte: :class:`ShardWriter`
    computes the byte ranges first, writes the header, then each tensor as it is fetched (from disk, one
    at a time), in the header's order. Its crc32c is taken from the same buffer, for the checkpoint's
    manifest. The header is padded with spaces to a multiple of 8 bytes, as the reference writer does, so
    the tensors are aligned for readers that map the file.

Note: [A checkpoint's writes do not pile up in the page cache]
    A checkpoint is written once and not read again by this process, but buffered writes leave its bytes
    in the page cache as dirty pages until the kernel writes them back: gigabytes of memory for a state
    that was kept off memory, and on this project's VM a buffered write ran at 0.18 GB/s against 2.4-2.9
    GB/s with O_DIRECT (benchmarks/results/states_from_checkpoint_2c24g-virtio_202611.md). So every
    :data:`SYNC_EVERY_BYTES` the writer flushes, ``fdatasync``s and drops the file's cached pages
    (``POSIX_FADV_DONTNEED``): the dirty bytes stay bounded and the disk writes while the next tensors
    are read.

Note: [Tensors are read with pread, not mapped]
    ``safe_open`` maps the whole file; every page a read touches then counts in the process's resident
    memory (and its peak) until the mapping goes, which for a shard of several gigabytes is the shard's
    size: exactly what loading straight to disk must avoid. :func:`read_into` reads one tensor's bytes
    with ``preadv`` into the tensor that receives them, so the resident memory of a load is the tensors
    being moved, whatever the file's size. The header is parsed and checked here (:func:`read_header`)
    before any tensor is read: sizes, dtypes, and byte ranges that cover the data exactly, so a truncated
    or malformed file is refused before anything is written.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from teraio.runtime.buffers import address_view
from teraio.runtime.integrity import make_checksum
from teraio.states.errors import CheckpointError

#: safetensors' dtype names, for the dtypes this torch has.
_DTYPE_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _DTYPE_NAMES.items() if hasattr(torch, attr)
}
_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}

#: Note: [A checkpoint's writes do not pile up in the page cache].
SYNC_EVERY_BYTES = 64 << 20
#: The reference implementation refuses larger headers too.
MAX_HEADER_BYTES = 100 << 20
_ALIGN_BYTES = 8


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"{dtype} has no safetensors dtype; cast it before saving") from None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: From the start of the file.
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A safetensors file's header, checked against the file's size."""

    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    file_bytes: int


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the tensor name {k!r} appears twice")
        out[k] = v
    return out


def read_header(path: str | os.PathLike) -> Header:
    """Parse and check ``path``'s header: every tensor's dtype, shape and byte range, the ranges covering
    the data exactly, and the file's size (a truncated file is refused here, before any read).

    Raises:
        CheckpointError: one line naming the file and the first problem.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"'{p}' does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open '{p}': {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"'{p}' is not a regular file")
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"'{p}' is not a safetensors file: {size} bytes, shorter than its header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"'{p}' is not a safetensors file or is truncated: its header claims {n} bytes, the file "
                f"has {size}"
            )
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"'{p}' has a malformed safetensors header: {exc}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"'{p}' has a malformed safetensors header: not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(f"'{p}': __metadata__ must map strings to strings")
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        entries[name] = _entry(p, name, info, data_start)
    end = data_start
    for e in sorted(entries.values(), key=lambda e: (e.offset_bytes, e.nbytes)):
        if e.offset_bytes != end:
            what = "overlaps the one before it" if e.offset_bytes < end else "leaves a hole before it"
            raise CheckpointError(f"'{p}': the byte range of tensor {e.name!r} {what}")
        end += e.nbytes
    if end != size:
        raise CheckpointError(
            f"'{p}' is truncated or has trailing bytes: its tensors end at byte {end}, the file has {size}"
        )
    return Header(p, entries, dict(meta), size)


def _entry(path: Path, name: str, info: object, data_start: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError(f"'{path}': tensor {name!r} is not described by an object")
    dtype = DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise CheckpointError(f"'{path}': tensor {name!r} has an unknown dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise CheckpointError(f"'{path}': tensor {name!r} has a malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"'{path}': tensor {name!r} has malformed data_offsets {offsets!r}")
    nbytes = _nbytes(dtype, shape)
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"'{path}': tensor {name!r} of shape {tuple(shape)} and dtype {info['dtype']} needs {nbytes} bytes, "
            f"its byte range has {offsets[1] - offsets[0]}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps ``t`` alive). Not through
    ``.numpy()``, which would leave the storage unresizable, and a parameter's storage is resized to zero
    when it goes to disk (Note: [A parameter keeps its storage object] in teraio.states.params)."""
    nbytes = t.numel() * t.element_size()
    return address_view(t.data_ptr(), nbytes) if nbytes else memoryview(b"")


def read_into(fd: int, entry: TensorEntry, out: torch.Tensor, *, path: str | os.PathLike = "") -> None:
    """Read ``entry``'s bytes into ``out`` (a contiguous CPU tensor of its dtype and shape) with ``preadv``
    (Note: [Tensors are read with pread, not mapped]).

    Raises:
        CheckpointError: the file ended early (it changed since its header was read).
    """
    assert out.is_contiguous() and out.device.type == "cpu" and out.dtype == entry.dtype
    assert tuple(out.shape) == entry.shape
    view = _bytes_of(out)
    done = 0
    while done < entry.nbytes:
        got = os.preadv(fd, [view[done:]], entry.offset_bytes + done)
        if got <= 0:
            raise CheckpointError(
                f"'{path}' ended inside tensor {entry.name!r} (it changed since it was opened): read it again"
            )
        done += got


def crc32c_of(t: torch.Tensor) -> int:
    """The crc32c of a contiguous CPU tensor's bytes (the runtime's checksum of offloaded bytes)."""
    fn = make_checksum("crc32c")
    assert fn is not None
    return fn(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else 0


@dataclass(frozen=True)
class Planned:
    """A tensor to write: its name, dtype and shape (known before its bytes are)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


def split_shards(tensors: Sequence[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    """Consecutive groups of at most ``max_shard_bytes`` each (a larger tensor is a shard of its own)."""
    shards: list[list[Planned]] = []
    size = 0
    for t in tensors:
        if not shards or (size + t.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


class ShardWriter:
    """One safetensors file written as a stream (Note: [A safetensors file is written as a stream]):
    the header at once, then each tensor by :meth:`write`, in the planned order.

    Args:
        f: a new, empty file opened for binary writing (the safe writer's).
        tensors: the tensors the file will hold, in the order they will be written.
        metadata: the header's ``__metadata__`` (strings).
    """

    def __init__(
        self, f: IO[bytes], tensors: Sequence[Planned], metadata: dict[str, str] | None = None
    ) -> None:
        self.f = f
        self.tensors = list(tensors)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for t in self.tensors:
            header[t.name] = {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _ALIGN_BYTES)
        f.write(struct.pack("<Q", len(raw)) + raw)
        self.data_bytes = offset
        self.file_bytes = 8 + len(raw) + offset
        self._next = 0
        self._unsynced_bytes = 0
        #: crc32c of each tensor's bytes, by name.
        self.crc32c: dict[str, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (its name, dtype and shape as planned)."""
        want = self.tensors[self._next]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise AssertionError(f"wrote {name} {tensor.dtype} {tuple(tensor.shape)}, planned {want}")
        t = tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()
        if t.numel():
            self.f.write(_bytes_of(t))
        self.crc32c[name] = crc32c_of(t)
        self._next += 1
        self._unsynced_bytes += t.numel() * t.element_size()
        if self._unsynced_bytes >= SYNC_EVERY_BYTES:
            self._sync()

    def _sync(self) -> None:
        """Note: [A checkpoint's writes do not pile up in the page cache]."""
        self.f.flush()
        fd = self.f.fileno()
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self._unsynced_bytes = 0

    def close(self) -> None:
        """Flush and fsync; every planned tensor must have been written."""
        if self._next != len(self.tensors):
            raise AssertionError(f"{len(self.tensors) - self._next} planned tensors were not written")
        self._sync()
        os.fsync(self.f.fileno())
        self.f.close()


def write_shards(
    open_new: Callable[[str], IO[bytes]],
    stem: str,
    tensors: Sequence[Planned],
    fetch: Callable[[Planned], torch.Tensor],
    *,
    max_shard_bytes: int,
    metadata: dict[str, str] | None = None,
    prefetch: Callable[[Planned], None] | None = None,
) -> dict[str, dict[str, int]]:
    """Write ``tensors`` as ``{stem}.safetensors``, or as Hugging Face shards
    ``{stem}-00001-of-0000N.safetensors`` with their ``{stem}.safetensors.index.json`` when they exceed
    ``max_shard_bytes``; each tensor's bytes come from ``fetch`` one at a time (and go when written),
    ``prefetch`` of the next one called before a tensor is written, so that its read overlaps the write.
    Returns the crc32c of every tensor by file and name."""
    shards = split_shards(tensors, max_shard_bytes) or [[]]
    n = len(shards)
    names = (
        [f"{stem}.safetensors"]
        if n == 1
        else [f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    sums: dict[str, dict[str, int]] = {}
    following = {id(a): b for a, b in zip(tensors, list(tensors)[1:])}
    if prefetch is not None and tensors:
        prefetch(tensors[0])
    for fname, shard in zip(names, shards):
        writer = ShardWriter(open_new(fname), shard, metadata)
        try:
            for t in shard:
                value = fetch(t)
                nxt = following.get(id(t))
                if prefetch is not None and nxt is not None:
                    prefetch(nxt)
                writer.write(t.name, value)
                del value
            writer.close()
        except BaseException:
            writer.f.close()
            raise
        sums[fname] = writer.crc32c
    if n > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: fname for fname, shard in zip(names, shards) for t in shard},
        }
        with open_new(f"{stem}.safetensors.index.json") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
    return sums


def files_of(directory: Path, stem: str) -> list[Path] | None:
    """The safetensors files of ``stem`` in ``directory``: ``{stem}.safetensors``, or the files its
    ``{stem}.safetensors.index.json`` names (None: neither exists).

    Raises:
        CheckpointError: a malformed index, or one naming a file outside the directory or missing.
    """
    single = directory / f"{stem}.safetensors"
    index_path = directory / f"{stem}.safetensors.index.json"
    if index_path.exists():
        try:
            index = json.loads(index_path.read_bytes())
            weight_map = index["weight_map"]
            assert isinstance(weight_map, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            raise CheckpointError(f"'{index_path}' is not a safetensors index (no weight_map)") from None
        files: list[Path] = []
        for fname in dict.fromkeys(weight_map.values()):
            if not isinstance(fname, str) or "/" in fname or fname in ("", ".", ".."):
                raise CheckpointError(f"'{index_path}' names a file outside its directory: {fname!r}")
            if not (directory / fname).is_file():
                raise CheckpointError(f"'{index_path}' names '{fname}', which is missing")
            files.append(directory / fname)
        return files
    if single.exists():
        return [single]
    return None


def headers_by_tensor(files: Iterable[Path]) -> dict[str, Header]:
    """Every tensor's header across ``files`` (a name in two files is refused)."""
    out: dict[str, Header] = {}
    for path in files:
        header = read_header(path)
        for name in header.entries:
            if name in out:
                raise CheckpointError(f"tensor {name!r} is in both '{out[name].path}' and '{path}'")
            out[name] = header
    return out

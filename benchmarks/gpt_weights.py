"""The GPT's initial weights written as a safetensors model directory without ever holding the model:
what ``bench_states --from-checkpoint`` loads with ``backend.states.load_pretrained`` (issue 39).

``build_gpt`` seeds torch's generator and runs ``GPT.__init__``, which draws every initial weight from it
in the order it constructs its submodules. :func:`init_modules` constructs the same submodules one at a
time, in the same order, from the same seed, so the random stream (and every weight) is the same bit for
bit (``tests/test_bench_states_smoke.py`` checks it against ``build_gpt``); :func:`write_gpt_weights`
streams each submodule's tensors into the file (Note: [A safetensors file is written as a stream] in
teraio.states.safetensors_files) and drops it before the next is built. The resident memory of the write
is one submodule (one block: 201 MB at hidden 2048), whatever the layer count.

Why here and not in ``teraio/tools/models``: only the benchmark needs a model file it cannot build in
memory, and ``benchmarks/states_reference.py`` already relies on ``GPT.__init__``'s construction order for
its layer-by-layer reference loss; a change to that order shows in the same test for both. A user with a
real checkpoint has no use for it.

Note: [The weights are written through the safe writer]
    The directory is built by teraio's own checkpoint writer (``write_directory`` in
    teraio.states.checkpoint_ranks): a fresh private directory next to the target, each file created
    ``O_CREAT|O_EXCL|O_NOFOLLOW`` and fsynced, then the directory renamed into place in one step. A run
    that dies mid-write leaves no directory that ``load_pretrained`` would take for complete.

Note: [The load reads the disk, not the page cache]
    The file was just written, so the kernel may still cache it, and ``load_pretrained``'s reads would
    then be copies from memory, not disk reads: the load's bandwidth would not compare with the raw read
    of the same run. The files are fsynced, so ``posix_fadvise(DONTNEED)`` drops their (clean) cached
    pages, and the load reads them from the disk as a downloaded checkpoint would be read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from teraio.states.checkpoint_ranks import write_directory
from teraio.states.safetensors_files import Planned, write_shards
from teraio.tools.models.gpt import GPT, Block, GPTConfig


def init_modules(cfg: GPTConfig, seed: int) -> Iterator[tuple[str, nn.Module]]:
    """``GPT(cfg)``'s submodules under their names, built one at a time in ``GPT.__init__``'s order from
    torch's generator seeded with ``seed`` (as ``build_gpt`` seeds it): the same random draws, so the same
    weights. The generator's state is restored when the iteration ends or is closed; the consumer must
    draw no random number between two submodules (it would shift the stream)."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        # GPT.__init__'s order: tok, pos, blocks (ModuleList of a generator: one after the other), ln_f,
        # head. nn.Module.__init__ draws nothing.
        yield "tok", nn.Embedding(cfg.vocab, cfg.hidden)
        yield "pos", nn.Embedding(cfg.seq, cfg.hidden)
        for i in range(cfg.layers):
            yield f"blocks.{i}", Block(cfg)
        yield "ln_f", nn.LayerNorm(cfg.hidden)
        yield "head", nn.Linear(cfg.hidden, cfg.vocab, bias=False)
    finally:
        torch.random.set_rng_state(gen_state)


def planned_tensors(cfg: GPTConfig) -> list[Planned]:
    """The names, dtypes and shapes of ``GPT(cfg)``'s state dict, in its order, from the model built on
    the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return [Planned(name, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()]


@dataclass
class WriteReport:
    """What :func:`write_gpt_weights` wrote."""

    directory: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    #: The tensors' bytes (the files' sizes without their headers).
    tensor_bytes: int = 0
    file_bytes: int = 0
    seconds: float = 0.0
    #: Cached pages of the files dropped after the write (Note: [The load reads the disk, not the page
    #: cache]).
    dropped_page_cache: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "files": list(self.files),
            "tensors": self.tensors,
            "tensor_bytes": self.tensor_bytes,
            "file_bytes": self.file_bytes,
            "seconds": self.seconds,
            "dropped_page_cache": self.dropped_page_cache,
        }


def _drop_page_cache(path: Path) -> bool:
    """Note: [The load reads the disk, not the page cache]."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def write_gpt_weights(
    cfg: GPTConfig,
    seed: int,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 1 << 62,
    drop_page_cache: bool = True,
) -> WriteReport:
    """Write the initial weights of ``GPT(cfg)`` built after ``torch.manual_seed(seed)`` to the new
    Hugging Face model directory ``directory`` (``model.safetensors``, or shards of at most
    ``max_shard_bytes`` with their index), one submodule in memory at a time (the module docstring).

    Raises:
        CheckpointError: ``directory`` exists.
        RuntimeError: the submodules built here do not make ``GPT(cfg)``'s state dict (GPT changed).
    """
    start = time.perf_counter()
    planned = planned_tensors(cfg)
    modules = init_modules(cfg, seed)
    pending: dict[str, torch.Tensor] = {}

    def fetch(pl: Planned) -> torch.Tensor:
        # The submodules come in the state dict's order: the next one is built only when the writer
        # has taken every tensor of the one before (which then goes).
        while pl.name not in pending:
            if pending:
                raise RuntimeError(
                    f"GPT's state dict has {pl.name!r} where the submodules built in GPT.__init__'s order "
                    f"have {next(iter(pending))!r}: benchmarks/gpt_weights.py no longer follows GPT.__init__"
                )
            try:
                prefix, module = next(modules)
            except StopIteration:
                raise RuntimeError(
                    f"GPT's state dict has {pl.name!r}, which no submodule built here makes: "
                    "benchmarks/gpt_weights.py no longer follows GPT.__init__"
                ) from None
            pending.update({f"{prefix}.{k}": v.detach() for k, v in module.state_dict().items()})
            del module
        return pending.pop(pl.name)

    report = WriteReport(directory=str(directory))

    def populate(d: Any) -> None:
        sums = write_shards(
            d.open_new, "model", planned, fetch, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"}
        )
        # Checked before the directory is renamed into place: a mismatch leaves no directory.
        leftover = next(modules, None)
        if pending or leftover is not None:
            name = next(iter(pending)) if pending else f"{leftover[0]}.*"  # type: ignore[index]
            raise RuntimeError(
                f"the submodules built in GPT.__init__'s order make {name!r}, which GPT's state dict does "
                "not have: benchmarks/gpt_weights.py no longer follows GPT.__init__"
            )
        report.files = list(sums)

    try:
        path = write_directory(directory, populate, what="model")
    finally:
        modules.close()  # restores the generator's state
    report.seconds = time.perf_counter() - start
    report.directory = str(path)
    report.tensors = len(planned)
    report.tensor_bytes = sum(pl.nbytes for pl in planned)
    names = sorted(os.listdir(path))
    report.file_bytes = sum((path / n).stat().st_size for n in names)
    if drop_page_cache:
        report.dropped_page_cache = all(
            [_drop_page_cache(path / n) for n in names if n.endswith(".safetensors")]
        )
    return report

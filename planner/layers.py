"""Repeated-layer recognition: which ops and tensors belong to which transformer layer, and which layers
are identical.

A 48-layer model is 48 copies of one block. The ILP (:mod:`planner.solvers.ilp`) reports the structure
it saw; :meth:`LayerStructure.windows` cuts the step into consecutive layer windows (for windowed
re-optimisation, and for benchmarks that look at one window). A layer is recognised from the ``module`` column: the first dotted component that is an integer names the
layer (``layers.3.mlp`` -> layer ``layers.3``; ``transformer.h.11.attn`` -> ``transformer.h.11``).
Two layers are *identical* when their forward and backward ops have the same relative names, targets
and durations (to ``rel_tol``) in the same order, and their saved tensors the same relative names, sizes
and op offsets. Memory from outside the layer (``other_bytes``, which grows with depth as gradients
accumulate) is deliberately not part of the signature: it is the context a layer sits in, not the layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from teraio.planner.profile import Profile

_LAYER_RE = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?[^.]+)\.(?P<idx>\d+)(?:\.|$)")


def layer_key(module: str | None) -> str | None:
    """The layer a module path belongs to (``"layers.3.mlp"`` -> ``"layers.3"``), or None."""
    if not module:
        return None
    m = _LAYER_RE.match(module)
    return f"{m.group('prefix')}.{m.group('idx')}" if m else None


@dataclass(frozen=True)
class LayerSpan:
    """One layer: its forward and backward op ranges (``[start, stop)``) and its saved tensors."""

    key: str
    fwd_start_idx: int
    fwd_stop_idx: int
    bwd_start_idx: int
    bwd_stop_idx: int
    tensor_names: tuple[str, ...]
    signature: tuple = field(repr=False, compare=False)


@dataclass(frozen=True)
class LayerStructure:
    """The layers of one step, in forward order, and the classes of identical layers."""

    layers: tuple[LayerSpan, ...]
    #: Indices into ``layers``, one tuple per class of identical layers, largest class first.
    classes: tuple[tuple[int, ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def largest_class(self) -> tuple[int, ...]:
        return self.classes[0] if self.classes else ()

    def summary(self) -> dict:
        """Small JSON-ready description (for solver stats and the benchmark)."""
        return {
            "layers": self.num_layers,
            "classes": len(self.classes),
            "largest_class": len(self.largest_class),
        }

    def windows(self, width: int, stride: int | None = None) -> list[tuple[int, ...]]:
        """Consecutive layer windows of ``width`` layers, ``stride`` apart (default: half overlapping)."""
        if width < 1:
            raise ValueError("window width must be at least 1")
        n = self.num_layers
        if n <= width:
            return [tuple(range(n))] if n else []
        stride = stride or max(1, width // 2)
        starts = list(range(0, n - width + 1, stride))
        if starts[-1] != n - width:
            starts.append(n - width)
        return [tuple(range(s, s + width)) for s in starts]


def _contiguous(idx: np.ndarray) -> tuple[int, int] | None:
    if idx.size == 0:
        return None
    lo, hi = int(idx.min()), int(idx.max()) + 1
    return (lo, hi) if hi - lo == idx.size else None


def find_layers(profile: Profile, rel_tol: float = 1e-6) -> LayerStructure:
    """Recognise the layers of ``profile`` and group identical ones.

    Ops whose module names no layer (embedding, head, loss) belong to no layer. A layer whose forward
    or backward ops are not contiguous is left out (it cannot be windowed).
    """
    ops = profile.ops
    nf = profile.num_fwd_ops
    if "module" not in ops.columns or len(ops) == 0:
        return LayerStructure(layers=(), classes=())
    keys = [layer_key(str(m)) if m is not None else None for m in ops["module"]]
    names = ops["name"].astype(str).tolist()
    targets = ops["target"].astype(str).tolist()
    durations = ops["duration_us"].to_numpy(dtype=float)
    t = profile.tensors
    t_keys = (
        [layer_key(str(m)) if m is not None else None for m in t["module"]] if "module" in t.columns else []
    )

    order: list[str] = []
    for k in keys[:nf]:
        if k is not None and k not in order:
            order.append(k)
    spans: list[LayerSpan] = []
    for key in order:
        idx = np.array([i for i, k in enumerate(keys) if k == key])
        fwd = _contiguous(idx[idx < nf])
        bwd = _contiguous(idx[idx >= nf])
        if fwd is None or bwd is None:
            continue

        def rel(name: str, key: str = key) -> str:
            return name.replace(key, "*")

        # Durations compared to a relative tolerance: quantise on a log scale.
        def q(x: float) -> int:
            return int(round(np.log1p(max(x, 0.0)) / max(rel_tol, 1e-12)))

        op_sig = tuple((rel(names[i]), targets[i], q(durations[i])) for i in (*range(*fwd), *range(*bwd)))
        rows = [k for k, tk in enumerate(t_keys) if tk == key and t["kind"].iat[k] == "activation"]
        t_sig = []
        for k in rows:
            offs = []
            for col in ("producer_idx", "last_fwd_use_idx", "first_bwd_use_idx", "last_use_idx"):
                v = int(t[col].iat[k])
                offs.append(-(10**9) if v < 0 else v - (fwd[0] if v < nf else bwd[0]))
            t_sig.append((rel(str(t["name"].iat[k])), int(t["nbytes"].iat[k]), *offs))
        spans.append(
            LayerSpan(
                key=key,
                fwd_start_idx=fwd[0],
                fwd_stop_idx=fwd[1],
                bwd_start_idx=bwd[0],
                bwd_stop_idx=bwd[1],
                tensor_names=tuple(str(t["name"].iat[k]) for k in rows),
                signature=(op_sig, tuple(sorted(t_sig))),
            )
        )
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(spans):
        groups.setdefault(s.signature, []).append(i)
    classes = sorted((tuple(g) for g in groups.values()), key=lambda g: (-len(g), g[0]))
    return LayerStructure(layers=tuple(spans), classes=tuple(classes))

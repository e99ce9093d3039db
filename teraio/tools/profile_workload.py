"""Profile a workload end to end: compile with the teraio backend, run the profiling steps, summarise.

Used by ``teraio profile`` and by notebooks; the summary ranks saved tensors by bytes x inactive time,
the quantity an offloading schedule can turn into saved memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from teraio.errors import CaptureError
from teraio.planner.profile import Profile
from teraio.tools.workloads import Workload, compute_loss

#: Steps beyond ``profile_steps`` a graph may need before its profile is done: with Inductor one step
#: runs its kernels under the torch profiler for their memory timeline (Note: [The budget is of the graph
#: that runs] in teraio.graph.kernel_memory), and is tried again when the profiler was busy.
EXTRA_PROFILE_STEPS = 4


def profile_workload(workload: Workload, profile_steps: int = 3, inner: str = "inductor") -> list[Profile]:
    """Run ``profile_steps`` forward+backward steps through the profiling backend, and the few more a
    graph may need to finish (``EXTRA_PROFILE_STEPS``); one Profile per graph."""
    from teraio.config import BackendConfig, Profiling
    from teraio.lifecycle.backend import TeraioBackend

    torch._dynamo.reset()
    be = TeraioBackend(BackendConfig(profiling=Profiling(steps=profile_steps), inner=inner, enabled=False))
    compiled = torch.compile(workload.model, backend=be)
    for step in range(profile_steps + EXTRA_PROFILE_STEPS):
        if step >= profile_steps and all(r.profile is not None for r in be.runners if r.is_training):
            break
        workload.model.zero_grad(set_to_none=True)
        loss = compute_loss(compiled, workload, step)
        loss.backward()
        be.profiles  # noqa: B018  (finishes the graphs that profiled enough)
    workload.model.zero_grad(set_to_none=True)
    profiles = be.profiles
    if not profiles:
        raise CaptureError(
            f"{workload.name}: no graph was captured with a backward pass; does the loss require grad?"
        )
    return profiles


def inactive_us(profile: Profile) -> np.ndarray:
    """Per tensor: microseconds between its last forward use and its first backward use (0 if unused)."""
    ends_us = np.cumsum(profile.ops["duration_us"].to_numpy())
    t = profile.tensors
    last_fwd, first_bwd = t["last_fwd_use_idx"].to_numpy(), t["first_bwd_use_idx"].to_numpy()
    out = np.zeros(len(t))
    ok = (first_bwd >= 0) & (last_fwd >= 0)
    starts_bwd = ends_us - profile.ops["duration_us"].to_numpy()
    out[ok] = starts_bwd[first_bwd[ok]] - ends_us[last_fwd[ok]]
    return np.maximum(out, 0.0)


def summarize(profile: Profile, top: int = 10) -> dict[str, Any]:
    """Figures a user wants first: step time, saved bytes by kind, and the best offload candidates."""
    t = profile.tensors.copy()
    t["inactive_us"] = inactive_us(profile)
    t["byte_s"] = t["nbytes"] * t["inactive_us"] / 1e6
    cands = t[t["offloadable"]].sort_values("byte_s", ascending=False).head(top)
    meta = profile.meta
    return {
        "graph_id": meta.get("graph_id", 0),
        "fingerprint": profile.fingerprint,
        "ops": len(profile.ops),
        "fwd_ops": profile.num_fwd_ops,
        "bwd_ops": len(profile.ops) - profile.num_fwd_ops,
        "step_s": meta.get("step_s"),
        "fwd_s": meta.get("fwd_s"),
        "bwd_s": meta.get("bwd_s"),
        "saved_tensors": len(t),
        "saved_outputs": meta.get("num_saved_outputs"),
        "activation_bytes": int(t.loc[t["kind"] == "activation", "nbytes"].sum()),
        "param_bytes": int(t.loc[t["kind"] == "param", "nbytes"].sum()),
        "input_bytes": int(t.loc[t["kind"] == "input", "nbytes"].sum()),
        "offloadable_tensors": int(t["offloadable"].sum()),
        "census_peak_bytes": meta.get("census_peak_bytes"),
        "top_tensors": [
            {
                "name": r.name,
                "nbytes": int(r.nbytes),
                "module": getattr(r, "module", ""),
                "inactive_s": float(r.inactive_us) / 1e6,
                "byte_s": float(r.byte_s),
            }
            for r in cands.itertuples()
        ],
    }

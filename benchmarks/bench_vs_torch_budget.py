"""teraio against PyTorch's own ``activation_memory_budget`` on Inductor, at the peaks torch reaches:
``python -m benchmarks.bench_vs_torch_budget [--models demo,hf-llama,hf-gpt2] [--ratios 0.5,0.2] [--json]``.

Per model, one process, one instrument for every run (the torch profiler's peak of a forward and
backward, ``teraio.profiling.measure.MemoryRecorder``, and the wall time of whole steps):

- ``torch``: ``torch.compile(model)`` (Inductor) with no budget, then at each ratio of ``--ratios``
  (``torch._functorch.config.activation_memory_budget`` while it compiles), and the peaks of a few low
  ratios (``--low-ratios``: the peak is not monotone in the ratio), whose lowest is torch's floor;
- ``teraio``: ``teraio.backend(inner="inductor", memory_budget=<torch's peak at the ratio>,
  solver=teraio.Solver(partitioner_budget="search"))``, and with ``--with-default-partition`` the same
  without the search (the plan at the default partition alone);
- ``teraio@0.3``: a budget of 0.3 of the no-budget peak (``torch_reaches``: whether torch's floor is within it).

Every method first runs until its plan runs (teraio) or its graph is compiled (torch), then the timed
steps run in interleaved rounds, one step of each method per round, so that the shared machine's slow and
fast periods fall on all alike; the medians are compared (``step_vs_torch``), and so are the steps of each
round (``step_vs_torch_paired``: the median over the rounds of teraio's step over torch's in the same
round). Freed CPU memory stays in the process for every
method (``--cpu-malloc retain``, as ``teraio demo`` does), so step times measure compute and I/O rather than
the kernel handing fresh pages to whichever method frees and allocates large buffers more often. It
reports; the tests assert.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Steps a teraio method may take to reach its plan (four candidates of profiling, each a few steps, and
#: the trial of the finalists: three rounds of up to three, each finalist's compile step too).
MAX_WARM_STEPS = 60


@dataclass
class Workload:
    name: str
    model: nn.Module
    batch: Callable[[int], tuple[Any, ...]]  # step -> inputs of model(*inputs), which returns the loss


class _LossOf(nn.Module):
    """An HF causal LM with its next-token loss inside the compiled graph."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )


def _ids(vocab: int, batch: int, seq: int) -> Callable[[int], tuple[Any, ...]]:
    def make(step: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(1_000_003 + step)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)

    return make


def workload(name: str) -> Workload:
    """The built-in demo GPT, or an HF model of about its step time."""
    torch.manual_seed(0)
    if name in ("demo", "tiny"):  # tiny: the smoke test's
        from teraio.tools.models.gpt import build_gpt, synthetic_batch

        gpt = build_gpt(name, seed=0)
        return Workload(name, gpt, lambda step: synthetic_batch(gpt.cfg, step, 0))
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            num_hidden_layers=4,
            hidden_size=512,
            intermediate_size=1376,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            vocab_size=8192,
            attention_dropout=0.0,
        )
        return Workload(name, _LossOf(LlamaForCausalLM(cfg)), _ids(8192, 4, 512))
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=4,
            n_embd=512,
            n_head=8,
            n_positions=512,
            vocab_size=8192,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return Workload(name, _LossOf(GPT2LMHeadModel(cfg)), _ids(8192, 4, 512))
    raise SystemExit(f"--models: unknown {name!r}; choose from demo, hf-llama, hf-gpt2, tiny")


@contextlib.contextmanager
def _ratio(ratio: float | None) -> Iterator[None]:
    if ratio is None:
        yield
        return
    with torch._functorch.config.patch(activation_memory_budget=ratio):
        yield


@dataclass
class Method:
    label: str
    model: nn.Module
    compiled: Any
    opt: torch.optim.Optimizer
    ratio: float | None = None  # torch's activation_memory_budget while compiling and running
    backend: Any = None
    steps_run: int = 0
    times_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    losses: list[float] = field(default_factory=list)

    def step(self, w: Workload, measure: bool = False) -> float:
        from teraio.profiling.measure import MemoryRecorder

        inputs = w.batch(self.steps_run)
        self.steps_run += 1
        rec = MemoryRecorder("cpu") if measure else None
        with _ratio(self.ratio):
            if rec is not None:
                rec.start()
            t0 = time.perf_counter()
            loss = self.compiled(*inputs)
            loss.backward()
            if rec is not None:
                rec.mark_end()
                self.peak_bytes = rec.stop().peak_bytes
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
        self.losses.append(float(loss.detach()))
        return dt

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


def inductor_at(ratio: float | None) -> Callable[..., Any]:
    """``backend="inductor"`` with the partitioner at ``ratio`` while it compiles. A backend object of its
    own: Dynamo serves a second instance of a model class the code compiled for the first when the
    backend is the same (parameters are graph inputs), so ``backend="inductor"`` under another ratio
    would run the first ratio's partition."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with _ratio(ratio):
            return compile_fx(gm, example_inputs)

    return backend


def _torch(w: Workload, ratio: float | None) -> Method:
    model = copy.deepcopy(w.model)
    m = Method(
        "torch" if ratio is None else f"torch@{ratio:g}",
        model,
        torch.compile(model, backend=inductor_at(ratio)),
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        ratio=ratio,
    )
    for _ in range(2):
        m.step(w)
    m.step(w, measure=True)
    return m


def _teraio(
    w: Workload,
    label: str,
    budget_bytes: int,
    search: bool,
    offload_dir: str,
    profile_steps: int | None = None,
) -> Method:
    import teraio

    model = copy.deepcopy(w.model)
    be = teraio.backend(
        memory_budget=budget_bytes,
        inner="inductor",
        offload_dirs=[offload_dir],
        solver=teraio.Solver(partitioner_budget="search" if search else None),
        profiling=teraio.Profiling(
            measure_memory=False, **({"steps": profile_steps} if profile_steps is not None else {})
        ),
    )
    m = Method(label, model, torch.compile(model, backend=be), torch.optim.AdamW(model.parameters(), lr=1e-4))
    m.backend = be
    while not be.settled or not be.runners:
        if m.steps_run >= MAX_WARM_STEPS:
            raise RuntimeError(f"{label}: no plan after {MAX_WARM_STEPS} steps")
        m.step(w)
    m.step(w)
    m.step(w, measure=True)
    return m


def run_model(
    name: str,
    ratios: list[float],
    floor_ratios: list[float],
    rounds: int,
    with_default: bool,
    offload_dir: str,
    profile_steps: int | None = None,
) -> dict[str, Any]:
    w = workload(name)
    methods: list[Method] = []
    rows: dict[str, dict[str, Any]] = {}
    try:
        base = _torch(w, None)
        methods.append(base)
        assert base.peak_bytes is not None
        # torch's lowest peak: the peak is not monotone in the ratio (ratio 0 recomputes everything into
        # the backward), so a few low ratios are measured and the lowest kept (not timed).
        floor_peaks: dict[float, int] = {}
        for r in floor_ratios:
            probe = _torch(w, r)
            assert probe.peak_bytes is not None
            floor_peaks[r] = probe.peak_bytes
        floor_ratio = min(floor_peaks, key=lambda r: floor_peaks[r])
        for r in ratios:
            t = _torch(w, r)
            methods.append(t)
            assert t.peak_bytes is not None
            te = _teraio(w, f"teraio@{r:g}", t.peak_bytes, True, offload_dir, profile_steps)
            methods.append(te)
            if with_default:
                methods.append(
                    _teraio(
                        w, f"teraio-default-partition@{r:g}", t.peak_bytes, False, offload_dir, profile_steps
                    )
                )
        low = int(0.3 * base.peak_bytes)
        try:
            methods.append(_teraio(w, "teraio@0.3", low, True, offload_dir, profile_steps))
        except Exception as exc:  # a budget below what teraio reaches is a result, reported
            rows["teraio@0.3"] = {"budget_bytes": low, "error": f"{type(exc).__name__}: {exc}"}
            smallest = getattr(exc, "smallest_peak_bytes", None)
            if smallest:  # teraio's own floor, against torch's lowest
                rows["teraio@0.3"]["smallest_peak_bytes"] = smallest
                rows["teraio@0.3"]["smallest_peak_vs_no_budget"] = smallest / base.peak_bytes
        for _ in range(rounds):
            for m in methods:
                m.times_s.append(m.step(w))
        for m in methods:
            row: dict[str, Any] = {
                "peak_bytes": m.peak_bytes,
                "peak_vs_no_budget": (m.peak_bytes or 0) / base.peak_bytes,
                "step_s": statistics.median(m.times_s),
                "steps_s": m.times_s,
            }
            if m.ratio is not None:
                row["activation_memory_budget"] = m.ratio
            if m.backend is not None:
                st = m.backend.stats()
                row["budget_bytes"] = m.backend.cfg.memory_budget
                row["predicted_peak_bytes"] = st["predicted_peak_bytes"]
                row["predicted_step_s"] = st["predicted_step_s"]
                row["partitioner_search"] = st["partitioner_search"]
                row["partitioner_budget"] = sorted(
                    {g["partitioner_budget"] for g in st["per_graph"] if g["partitioner_budget"] is not None}
                )
                row["moved_bytes_per_step"] = st["moved_bytes_per_step"]
            rows[m.label] = row
        for r in ratios:
            t = rows[f"torch@{r:g}"]
            for label in (f"teraio@{r:g}", f"teraio-default-partition@{r:g}"):
                te = rows.get(label)
                if te is None:
                    continue
                te["step_vs_torch"] = te["step_s"] / t["step_s"]
                # Per round, the step against torch's of the same round (a drift of the machine falls on
                # both), then the median over the rounds.
                te["step_vs_torch_paired"] = statistics.median(
                    a / b for a, b in zip(te["steps_s"], t["steps_s"], strict=True)
                )
                te["peak_vs_torch"] = te["peak_bytes"] / t["peak_bytes"]
        if "teraio@0.3" in rows:
            rows["teraio@0.3"]["torch_reaches"] = floor_peaks[floor_ratio] <= low
    finally:
        for m in methods:
            m.close()
        methods.clear()
        gc.collect()
    return {
        "model": name,
        "rounds": rounds,
        "rows": rows,
        "torch_peak_by_low_ratio": floor_peaks,
        "torch_lowest_peak": {"ratio": floor_ratio, "peak_bytes": floor_peaks[floor_ratio]},
    }


def main(argv: list[str] | None = None) -> int:
    from teraio.sizes import format_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--models", default="demo", help="comma-separated, of demo, hf-llama, hf-gpt2 (default demo)"
    )
    ap.add_argument(
        "--ratios", default="0.5,0.2", help="torch's activation_memory_budget ratios (default 0.5,0.2)"
    )
    ap.add_argument(
        "--low-ratios",
        default="0,0.1,0.2",
        help="ratios whose torch peaks are measured to find torch's lowest (default 0,0.1,0.2)",
    )
    # 11, not 5: where teraio's best is close to the partitioner's own recompute the two nearly tie, and
    # one 5-round run of the demo measured 1.03-1.04x torch's step where two 11-round runs measured
    # 0.93-0.99x (benchmarks/results/vs_torch_budget_2c24g-virtio_202611.md); the rounds are about a tenth
    # of the run's time, the compiles and profiling the rest.
    ap.add_argument("--rounds", type=int, default=11, help="timed interleaved rounds (default 11)")
    ap.add_argument(
        "--with-default-partition",
        action="store_true",
        help="also run teraio without the partitioner search (its plan at the default partition)",
    )
    ap.add_argument(
        "--offload-dir", default=None, help="where teraio offloads (default: a temporary directory)"
    )
    ap.add_argument(
        "--cpu-malloc",
        choices=("retain", "release"),
        default="retain",
        help="freed CPU memory kept in the process for reuse, for every method alike, as teraio demo does "
        "(default retain; Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc)",
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="teraio.Profiling(steps=N) for every teraio method (default: teraio's own default)",
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    from teraio.platform.cpu_malloc import apply_cpu_malloc

    cpu_malloc = apply_cpu_malloc(args.cpu_malloc)
    ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
    # Every method compiles its own copy of one model class: one Dynamo entry each.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    results = []
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        for name in [x.strip() for x in args.models.split(",") if x.strip()]:
            t0 = time.perf_counter()
            low = [float(x) for x in args.low_ratios.split(",") if x.strip()]
            res = run_model(
                name, ratios, low, args.rounds, args.with_default_partition, tmp, args.profile_steps
            )
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            if not args.json:
                print(f"{name} ({res['wall_s']:.0f} s):", file=sys.stderr)
                for label, row in res["rows"].items():
                    if "error" in row:
                        print(f"  {label:32s} {row['error']}", file=sys.stderr)
                        continue
                    extra = ""
                    if "step_vs_torch" in row:
                        extra = (
                            f"  step {row['step_vs_torch']:.3f}x torch's (per round "
                            f"{row['step_vs_torch_paired']:.3f}x), peak {row['peak_vs_torch']:.3f}x"
                        )
                    if row.get("partitioner_budget"):
                        extra += f"  ran at ratio {row['partitioner_budget']}"
                    print(
                        f"  {label:32s} peak {format_size(row['peak_bytes']):>10s} "
                        f"({row['peak_vs_no_budget']:.2f})  step {row['step_s']:.3f} s{extra}",
                        file=sys.stderr,
                    )
    out = {
        "torch_version": torch.__version__,
        "cpu_malloc": cpu_malloc,
        "profile_steps": args.profile_steps,
        "results": results,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

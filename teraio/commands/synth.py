"""``teraio synth``: write a synthetic GPT training-step Profile (for planning without profiling).

Defaults match the mid-size GPT measured in docs/measured_facts.md (6 layers, hidden 384, seq 512, batch 8).
"""

from __future__ import annotations

import argparse
import json

from teraio.commands.plan import add_force_option
from teraio.errors import UserInputError
from teraio.planner.limits import MAX_SYNTH_DIM, MAX_SYNTH_LAYERS, MAX_TFLOPS
from teraio.planner.safe_io import check_output_dir
from teraio.sizes import format_size


def _positive_int(text: str, most: int = MAX_SYNTH_DIM) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be in 1..{most}, got {value}")
    return value


def _layers(text: str) -> int:
    return _positive_int(text, MAX_SYNTH_LAYERS)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "synth",
        help="write a synthetic GPT training-step profile (N layers; sizes and op times from the shapes)",
        description="Write the Profile of an N-layer GPT training step built from shapes and FLOPs, without "
        "tracing anything: saved-tensor sizes from the shapes (float32), op times from FLOPs and bytes "
        "touched, backward ~2x forward. Defaults match the mid-size GPT of docs/measured_facts.md.",
    )
    p.add_argument("--layers", "-n", type=_layers, default=6, help="transformer layers (default 6)")
    p.add_argument("--hidden", type=_positive_int, default=384, help="hidden size (default 384)")
    p.add_argument("--seq", type=_positive_int, default=512, help="sequence length (default 512)")
    p.add_argument("--batch", type=_positive_int, default=8, help="batch size (default 8)")
    p.add_argument("--heads", type=_positive_int, default=None, help="attention heads (default hidden/64)")
    p.add_argument("--vocab", type=_positive_int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument(
        "--attention",
        choices=["fused", "explicit"],
        default="fused",
        help="fused SDPA (saves q/k/v, output, lse) or explicit scores/softmax (saves probs)",
    )
    p.add_argument(
        "--tflops",
        type=float,
        default=None,
        help="matmul throughput in TFLOP/s for op times (default 0.16: this 2-core CPU)",
    )
    p.add_argument("--out", "-o", required=True, help="profile directory to write")
    add_force_option(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from teraio.planner.lifetimes import analyse
    from teraio.planner.synth import synth_profile

    out = check_output_dir(args.out, ("profile",), force=args.force)
    extra = {}
    if args.tflops is not None:
        if not 0 < args.tflops <= MAX_TFLOPS:  # also NaN and inf
            raise UserInputError(f"--tflops must be positive and at most {MAX_TFLOPS:g}, got {args.tflops}")
        extra["flops_per_s"] = args.tflops * 1e12
    if args.heads is not None:
        extra["heads"] = args.heads
    profile = synth_profile(
        layers=args.layers,
        hidden=args.hidden,
        seq=args.seq,
        batch=args.batch,
        vocab=args.vocab,
        attention=args.attention,
        **extra,
    )
    profile.save(out, force=args.force)
    lt = analyse(profile)
    summary = {
        "out": str(out),
        "fingerprint": profile.fingerprint,
        "ops": len(profile.ops),
        "fwd_ops": profile.num_fwd_ops,
        "fwd_s": profile.meta["fwd_s"],
        "bwd_s": profile.meta["bwd_s"],
        "saved_activation_bytes": profile.activation_bytes(),
        "candidates": len(lt.candidates),
        "baseline_peak_bytes": lt.baseline_peak_bytes,
        "min_feasible_peak_bytes": lt.min_feasible_peak_bytes,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"wrote {out}: {args.layers} layers, {summary['ops']} ops ({summary['fwd_ops']} forward), "
        f"step {summary['fwd_s'] + summary['bwd_s']:.3f} s (fwd {summary['fwd_s']:.3f} s), saved activations "
        f"{format_size(summary['saved_activation_bytes'])}, unplanned peak {format_size(lt.baseline_peak_bytes)}, "
        f"smallest achievable peak {format_size(lt.min_feasible_peak_bytes)}"
    )
    return 0

"""The whole-step budget on the suite's models, as figures: ``python -m benchmarks.bench_whole_step_budget
[--budgets 40%,60%] [--json]``.

The same runs as ``tests/teraio/test_whole_step_budget.py`` (whose model builders and loop it reuses):
each model with AdamW, parameters, gradients and optimizer states on disk, the default ``chunk_bytes``,
at each budget. Per run: the budget, the plan's predicted whole-step peak, the measured one (the
optimizer step included), their ratios, the chunk size the plan cut, and whether losses, parameters and
optimizer states equal the same loop without teraio. It reports; the test asserts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import torch


def _same(ref: dict[str, Any], got: dict[str, Any]) -> bool:
    return (
        all(torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"], strict=True))
        and all(torch.equal(ref["params"][n], got["params"][n]) for n in ref["params"])
        and all(
            torch.equal(ref["state"][i][k], got["state"][i][k]) for i in ref["state"] for k in ref["state"][i]
        )
    )


def main(argv: list[str] | None = None) -> int:
    from tests.teraio.test_whole_step_budget import MODELS, _run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="40%,60%", help="comma-separated memory budgets (default 40%%,60%%)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            ref = _run(name, False, "40%", f"{tmp}/ref-{name}")
            for budget in args.budgets.split(","):
                got = _run(name, True, budget, f"{tmp}/{name}-{budget}")
                w = got["whole"]
                rows.append(
                    {
                        "model": name,
                        "budget": budget,
                        "budget_bytes": w["budget_bytes"],
                        "predicted_peak_bytes": w["predicted_peak_bytes"],
                        "measured_peak_bytes": w["measured_peak_bytes"],
                        "predicted_of_budget": w["predicted_peak_bytes"] / w["budget_bytes"],
                        "measured_of_predicted": w["measured_peak_bytes"] / w["predicted_peak_bytes"],
                        "measured_of_budget": w["measured_peak_bytes"] / w["budget_bytes"],
                        "chunk_bytes": w["chunk_bytes"],
                        "measured_moments": w["measured_moments"],
                        "bit_identical": _same(ref, got),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'model':10} {'budget':>6} {'budget B':>10} {'pred/budget':>11} {'meas/pred':>9} {'meas/budget':>11} {'chunk B':>10} exact"
    )
    for r in rows:
        print(
            f"{r['model']:10} {r['budget']:>6} {r['budget_bytes']:>10} {r['predicted_of_budget']:>11.3f} "
            f"{r['measured_of_predicted']:>9.3f} {r['measured_of_budget']:>11.3f} {r['chunk_bytes']:>10} "
            f"{r['bit_identical']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

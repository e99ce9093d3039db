"""``teraio calibrate DIR``: measure an offload directory's write/read bandwidth and latency and write a
HardwareModel JSON for ``teraio plan --hardware``."""

from __future__ import annotations

import argparse
import json
import statistics

from teraio.commands.plan import add_force_option, check_count
from teraio.errors import UserInputError
from teraio.planner.safe_io import check_output_file
from teraio.platform.preflight import check_writable_dir
from teraio.sizes import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure an offload directory's bandwidth and latency; write a hardware model JSON",
        description="Time the runtime engine (posix, O_DIRECT) and raw aligned O_DIRECT I/O on DIR, in one run, "
        "and write the medians into the SSD tier of a hardware model.",
    )
    p.add_argument("dir", help="directory on the disk you will offload to")
    p.add_argument("--out", "-o", help="hardware model JSON to write (default: print only)")
    add_force_option(p)
    p.add_argument("--size", default="256MiB", help="bytes per measurement (default 256MiB)")
    p.add_argument("--block", default="4MiB", help="O_DIRECT request size (default 4MiB)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; the model takes medians (default 3)")
    p.add_argument("--raw-only", action="store_true", help="skip the runtime engine; model raw O_DIRECT I/O")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from teraio.planner.budget import BudgetError, parse_size
    from teraio.profiling.disk_calibration import calibrate

    try:
        nbytes, block = parse_size(args.size), parse_size(args.block)
    except BudgetError as e:
        raise UserInputError(str(e)) from None
    from teraio.planner.limits import MAX_REPEATS

    check_count(args.repeats, "--repeats", 1, MAX_REPEATS)
    check_writable_dir(args.dir, option="calibrate DIR", create=False)  # written now, not after minutes
    if args.out is not None:
        check_output_file(args.out, overwrite=args.force, option="--out")
    cal = calibrate(
        args.dir, nbytes=nbytes, block_nbytes=block, repeats=args.repeats, use_engine=not args.raw_only
    )
    hw = cal.hardware_model()
    if args.out is not None:
        hw.save(args.out, overwrite=args.force)
    if args.json:
        print(json.dumps({**cal.to_dict(), "hardware": hw.to_dict(), "out": args.out}, indent=2))
        return 0
    print(
        f"calibrated {cal.dir} ({cal.fs_type}), {format_size(cal.nbytes)} x {cal.repeats}, model from {cal.method}"
    )
    print(
        f"  model   write {cal.write_bw_bytes_per_s / 1e9:.2f} GB/s, read {cal.read_bw_bytes_per_s / 1e9:.2f} GB/s"
    )
    print(
        f"  O_DIRECT write {cal.direct_write_bw_bytes_per_s / 1e9:.2f} GB/s, read "
        f"{cal.direct_read_bw_bytes_per_s / 1e9:.2f} GB/s (raw baseline)"
    )
    print(
        f"  latency write {cal.write_latency_s * 1e6:.0f} us, read {cal.read_latency_s * 1e6:.0f} us (4 KiB via the "
        f"model's method; O_DIRECT alone {cal.direct_write_latency_s * 1e6:.0f} / {cal.direct_read_latency_s * 1e6:.0f} us)"
    )
    if cal.cpu_s_per_transfer:
        calls = statistics.median(cal.samples["op_calls_round_trip_s"]) / 2
        what = f"the migration ops' calls: {calls * 1e6:.0f} us alone"
        if cal.samples.get("round_trip_under_compute_s"):
            io_cpu = statistics.median(cal.samples["io_threads_cpu_round_trip_s"]) / 2
            what = f"measured under compute; alone, the calls take {calls * 1e6:.0f} us and the I/O threads {io_cpu * 1e6:.0f} us of CPU"
        print(
            f"  compute per transfer {cal.cpu_s_per_transfer * 1e6:.0f} us ({what}; charged to the step "
            "for every tensor moved each way)"
        )
    for w in cal.warnings:
        print(f"  warning: {w}")
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0

"""The backend writes only what it owns: a planted stats.jsonl link is not followed."""

from __future__ import annotations

import logging

import teraio
from teraio.workload import builtin_workload

from .training import train

#: The options the brief's scenario uses: a few fast steps of the tiny model on the FX-only path.
FAST = {
    "memory_budget": "70%",
    "inner": "eager",
    "solver": "greedy",
    "profile_steps": 1,
    "io_backend": "posix",
}


# --------------------------------------------------------------------------------------- stats.jsonl
def test_stats_log_never_follows_a_link_planted_in_a_shared_run_dir(tmp_path, caplog) -> None:
    """stats.jsonl was opened with open(..., "a"): a link planted in a shared run_dir was appended to."""
    caplog.set_level(logging.WARNING, logger="teraio")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)  # world-writable, no sticky bit: anyone may plant a name in it
    be = teraio.backend(**FAST, run_dir=str(run_dir), offload_dirs=[str(tmp_path)])
    (run_dir / "stats.jsonl").symlink_to(victim)  # planted after the run started
    try:
        train(builtin_workload("tiny"), be, 4)
    finally:
        be.close()
    assert be.step_times_s, "no running step ended: the stats log was never written"
    assert victim.read_text() == "precious\n"
    assert (run_dir / "stats.jsonl").is_symlink()
    warned = [r.getMessage() for r in caplog.records if "stats" in r.getMessage()]
    assert len(warned) == 1 and "stats.jsonl" in warned[0], warned  # said once, training went on

"""``python -m benchmarks.gpu_check`` runs here too: without CUDA it says so on every line and exits 0, and
the ``host_blocking`` and ``ordering`` checks' code runs with the fake device standing in for CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour; on a GPU the checks really run")
def test_without_cuda_every_check_is_skipped_with_the_reason(capsys):
    assert gpu_check.main([]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1] for line in lines] == list(gpu_check.CHECKS)
    assert "host_blocking" in gpu_check.CHECKS and "ordering" in gpu_check.CHECKS
    assert all(line.startswith("SKIP") and "CUDA absent" in line for line in lines)


def test_unknown_check_is_refused():
    with pytest.raises(ValueError, match="unknown check"):
        gpu_check.run(only=["bogus"])
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--only", "bogus"])
    assert info.value.code == 2


def test_host_blocking_and_ordering_rehearse_on_the_fake_device(tmp_path):
    """The checks' own code with the fake device: every consumer saw the produced bytes, the compute
    stream was still busy when the last fetch and drop returned, and the fake's host-blocked detector saw
    no wait behind it; checksums on and off, host and posix tiers."""
    verdicts = gpu_check.rehearse_on_fake_device(tmp_path)
    names = [v.check for v in verdicts]
    assert names == [
        f"{check}[{tier},checksum={cs},fake]"
        for tier in ("host", "posix")
        for cs in ("on", "off")
        for check in ("ordering", "host_blocking")
    ]
    assert all(v.verdict == "PASS" for v in verdicts), [v for v in verdicts if v.verdict != "PASS"]
    assert all("compute still busy after: True" in v.detail for v in verdicts if v.check.startswith("host"))


def test_host_blocking_verdict_fails_a_call_that_waited_or_compute_that_was_idle():
    quick = {"fetch_ms": [0.3, 0.2], "drop_ms": [0.1], "still_busy": True, "bytes_ok": True}
    assert gpu_check.host_blocking_verdict("x", quick).verdict == "PASS"
    slow = dict(quick, fetch_ms=[0.3, gpu_check.HOST_BLOCKING_MAX_MS + 1])
    assert gpu_check.host_blocking_verdict("x", slow).verdict == "FAIL"
    assert gpu_check.host_blocking_verdict("x", slow, timed=False).verdict == "PASS"
    assert gpu_check.host_blocking_verdict("x", dict(quick, still_busy=False)).verdict == "FAIL"
    assert gpu_check.host_blocking_verdict("x", dict(quick, bytes_ok=False)).verdict == "FAIL"


def test_the_rehearsal_fails_when_fetch_or_drop_wait_on_compute(tmp_path, monkeypatch):
    """The rehearsal can fail: with drop waiting on the host for a read's device copies (the old
    behaviour), the fake's detector fires and the host_blocking verdicts say FAIL."""
    from teraio.runtime.engine import Engine

    def settle_by_host_wait(self, req) -> None:
        for event in list(req.device_events):
            self._dev.synchronize_event(event)

    monkeypatch.setattr(Engine, "_settle_device", settle_by_host_wait)
    verdicts = {v.check: v for v in gpu_check.rehearse_on_fake_device(tmp_path)}
    assert verdicts["host_blocking[posix,checksum=on,fake]"].verdict == "FAIL"
    assert "HostBlockedError" in verdicts["host_blocking[posix,checksum=on,fake]"].detail

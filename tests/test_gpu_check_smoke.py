"""``python -m benchmarks.gpu_check`` runs here too: without CUDA it says so on every line and exits 0."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour; on a GPU the checks really run")
def test_without_cuda_every_check_is_skipped_with_the_reason(capsys):
    assert gpu_check.main([]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1] for line in lines] == list(gpu_check.CHECKS)
    assert all(line.startswith("SKIP") and "CUDA absent" in line for line in lines)


def test_unknown_check_is_refused():
    with pytest.raises(ValueError, match="unknown check"):
        gpu_check.run(only=["bogus"])
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--only", "bogus"])
    assert info.value.code == 2

"""The roofline cost model and the hardware presets (planner/costmodel.py, planner/presets/*.json)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from teraio.planner.costmodel import (
    ComputeModel,
    CostModelError,
    figures_without_source,
    load_preset,
    preset_from_dict,
    preset_names,
)

SHIPPED = ("a100-40g-g10", "cpu-local", "h100-nvl-4x990pro", "h100-sxm-1ssd")


def _preset_dict(name: str) -> dict:
    return json.loads((resources.files("teraio.planner") / "presets" / f"{name}.json").read_text())


def test_roofline_takes_the_slower_of_compute_and_memory():
    m = ComputeModel({"float32": 1e12, "bfloat16": 4e12}, mem_bw_bytes_per_s=1e11, kernel_overhead_s=1e-6)
    # 2e12 FLOPs take 2 s at 1 TFLOP/s; its 1e9 bytes take 0.01 s: compute-bound.
    assert m.op_seconds(2e12, 1e9, "float32") == pytest.approx(2.0 + 1e-6)
    assert m.op_seconds(2e12, 1e9, "bfloat16") == pytest.approx(0.5 + 1e-6)
    # No FLOPs: memory-bound, 1e9 bytes at 1e11 B/s.
    assert m.op_seconds(0, 1e9, "float32") == pytest.approx(0.01 + 1e-6)
    assert m.op_seconds(0, 1e9, "float32", kernel=False) == 0.0  # a view
    with pytest.raises(CostModelError, match="no matmul rate for dtype 'float16'"):
        m.op_seconds(1, 1, "float16")


def test_the_issue_presets_ship_with_the_package():
    assert set(SHIPPED) <= set(preset_names())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_figure_of_a_preset_has_its_source(name):
    d = _preset_dict(name)
    assert figures_without_source(d) == []
    p = load_preset(name)
    assert p.name == name and p.hardware.tier("ssd").count >= 1


def test_a_figure_without_a_source_is_refused():
    d = _preset_dict("h100-nvl-4x990pro")
    del d["sources"]["compute.mem_bw_bytes_per_s"]
    with pytest.raises(CostModelError, match="figure 'compute.mem_bw_bytes_per_s' has no entry in 'sources'"):
        preset_from_dict(d, "test")


def test_the_published_setups_are_what_the_issue_names():
    nvl = load_preset("h100-nvl-4x990pro").hardware.tier("ssd")
    assert nvl.count == 4 and nvl.total_read_bw_bytes_per_s == pytest.approx(16e9)  # TERAIO's ~16 GB/s
    g10 = load_preset("a100-40g-g10")
    assert g10.compute.device_memory_bytes == 40_000_000_000
    assert g10.hardware.tier("ssd").read_bw_bytes_per_s == pytest.approx(3.2e9)
    assert g10.link_bw_bytes_per_s == pytest.approx(15.75e9)


def test_more_drives_than_the_link_feeds_add_nothing():
    p = load_preset("h100-nvl-4x990pro")
    assert p.hardware_with(ssds=8).tier("ssd").total_read_bw_bytes_per_s == pytest.approx(32e9)
    # 32 drives at 4 GB/s would be 128 GB/s; PCIe Gen5 x16 carries 64 GB/s a direction.
    assert p.hardware_with(ssds=32).tier("ssd").total_read_bw_bytes_per_s == pytest.approx(64e9)
    one = p.hardware_with(ssds=1, ssd_bw_bytes_per_s=7e9)
    assert one.tier("ssd").total_write_bw_bytes_per_s == pytest.approx(7e9)
    assert one.name.startswith("h100-nvl-4x990pro,")  # the plan's hardware says it was changed
    g10 = load_preset("a100-40g-g10")  # G10's 15.75 GB/s link caps eight 3.2 GB/s drives
    assert g10.hardware_with(ssds=8).tier("ssd").total_read_bw_bytes_per_s == pytest.approx(15.75e9)
    with pytest.raises(CostModelError, match="--ssds"):
        p.hardware_with(ssds=0)


def test_unknown_and_malformed_presets_say_what_to_do(tmp_path):
    with pytest.raises(CostModelError, match="unknown hardware preset 'h200'; choose one of: a100-40g-g10"):
        load_preset("h200")
    with pytest.raises(CostModelError, match="does not exist"):
        load_preset(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(CostModelError, match="not valid JSON"):
        load_preset(str(bad))
    d = _preset_dict("cpu-local")
    d["compute"]["matmul_flops_per_s"]["int8"] = 1e12
    d["sources"]["compute.matmul_flops_per_s.int8"] = "test"
    f = tmp_path / "int8.json"
    f.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match="dtype 'int8'"):
        load_preset(str(f))
    # A user's own preset file loads like a shipped one.
    d = _preset_dict("cpu-local")
    d["name"] = "mine"
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(d))
    assert load_preset(str(mine)).name == "mine"

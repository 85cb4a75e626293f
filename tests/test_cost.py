"""GPU pricing: NVML names to the price table, overrides, USD from GPU-milliseconds."""

import math

import pytest

from tracer.correlate.cost import (
    DEFAULT_PRICES,
    FALLBACK_USD_PER_GPU_HOUR,
    GpuDetection,
    GpuPricing,
    cost_usd,
    detect_gpu_model,
    match_model,
)

# names as nvmlDeviceGetName returns them on the real parts
NVML_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200",
    "NVIDIA GH200 480GB": "gh200",
    "NVIDIA B200": "b200",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA L4": "l4",
    "NVIDIA A10G": "a10g",
    "NVIDIA A10": "a10",
    "Tesla T4": "t4",
    "Tesla V100-SXM2-16GB": "v100",
}


@pytest.mark.parametrize("name,key", sorted(NVML_NAMES.items()))
def test_nvml_names_match_the_right_entry(name, key):
    assert match_model(name).key == key


def test_keys_and_loose_spellings_match_and_unknowns_do_not():
    assert match_model("a100-80gb").key == "a100-80gb"
    assert match_model("h100").key == "h100-sxm"
    assert match_model("h100 pcie").key == "h100-pcie"
    for name in ("NVIDIA GeForce RTX 4090", "", "   ", None, "AMD Instinct MI300X"):
        assert match_model(name) is None


def test_the_table_is_sane():
    keys = [p.key for p in DEFAULT_PRICES]
    assert len(keys) == len(set(keys))
    for p in DEFAULT_PRICES:
        assert 0.1 < p.usd_per_hour < 20, p
        assert match_model(p.name) is p, p  # every entry is reachable by its own name
    by = {p.key: p.usd_per_hour for p in DEFAULT_PRICES}
    assert by["t4"] < by["l4"] < by["a100-40gb"] < by["a100-80gb"] < by["h100-sxm"] < by["b200"]


def test_cost_usd():
    assert cost_usd(3_600_000, 2.5) == pytest.approx(2.5)  # one GPU-hour
    assert cost_usd(1.0, 3.6) == pytest.approx(1e-6)
    assert cost_usd(0, 4.0) == 0.0
    for bad in ((-1, 2.0), (1, -2.0), (math.nan, 1.0), (1.0, math.inf), ("5", 1.0),
                (True, 1.0)):
        with pytest.raises(ValueError):
            cost_usd(*bad)


def test_nvml_on_this_host_answers_without_raising():
    found = detect_gpu_model()
    # either names (a GPU host) or the reason there are none (this VM has no driver)
    assert bool(found.names) or bool(found.reason)
    if found.names:
        assert found.name in found.names
    else:
        assert found.name is None and "NVML" in found.reason


def test_resolve_order_explicit_price_then_model_then_nvml_then_fallback():
    h100 = lambda: GpuDetection(("NVIDIA H100 80GB HBM3",) * 8)  # noqa: E731
    p = GpuPricing.resolve(price=1.25, detect=h100)
    assert (p.usd_per_gpu_hour, p.source, p.model) == (1.25, "explicit", "NVIDIA H100 80GB HBM3")
    p = GpuPricing.resolve(model="l4", detect=h100)
    assert (p.usd_per_gpu_hour, p.source, p.model) == (0.80, "default:l4", "l4")
    p = GpuPricing.resolve(detect=h100)
    assert (p.usd_per_gpu_hour, p.source) == (3.78, "default:h100-sxm")
    p = GpuPricing.resolve(detect=lambda: GpuDetection(reason="no driver"))
    assert (p.usd_per_gpu_hour, p.source, p.model) == (FALLBACK_USD_PER_GPU_HOUR, "fallback", None)
    assert p.notes == ("no driver",) and "no driver" in p.describe()
    p = GpuPricing.resolve(model="Radeon 9000", detect=h100)
    assert p.source == "fallback" and "Radeon 9000" in p.notes[0]
    with pytest.raises(ValueError):
        GpuPricing.resolve(price=-3)


def test_mixed_hosts_take_the_most_common_model_and_say_so():
    found = GpuDetection(("NVIDIA L4", "NVIDIA A100-SXM4-80GB", "NVIDIA L4"),
                         "mixed GPU models: NVIDIA A100-SXM4-80GB, NVIDIA L4")
    p = GpuPricing.resolve(detect=lambda: found)
    assert p.model == "NVIDIA L4" and p.source == "default:l4" and "mixed" in p.notes[0]


def test_attributes_for_a_record():
    p = GpuPricing(3.6, "NVIDIA H100 80GB HBM3", "default:h100-sxm")
    a = p.attributes(500.0)
    assert a == {"cost.price_per_gpu_hour": 3.6, "cost.price_source": "default:h100-sxm",
                 "gpu.model": "NVIDIA H100 80GB HBM3", "cost.usd": pytest.approx(0.0005)}
    # unknown GPU time: no cost at all, not a cost of zero
    assert "cost.usd" not in p.attributes(None)


def test_the_documented_table_is_the_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[2][:1].isdigit():
            rows[cells[0].strip("`")] = float(cells[2])
    assert rows == {p.key: p.usd_per_hour for p in DEFAULT_PRICES}
    assert f"{FALLBACK_USD_PER_GPU_HOUR:.2f} (fallback)" in doc

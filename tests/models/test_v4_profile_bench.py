"""``bench/v4_decode_profile.py``'s kernel classes: our Triton kernels (which the profiler does not
tie to the scope that launched them) go to their class by name, and an earlier result's graphs
rows can be reclassified from their kernel tables without re-measuring."""
from __future__ import annotations

import json

import pytest

from bench import v4_decode_profile as prof


def test_a_kernel_takes_the_scoped_passs_classes_then_its_triton_name_then_unmapped():
    seen = {"gemm_x": {"projections": 0.75, "logits": 0.25}, "_w2_kernel": {"moe": 1.0}}
    assert prof.kernel_class("gemm_x", seen) == {"projections": 0.75, "logits": 0.25}
    assert prof.kernel_class("_w13_swiglu_kernel", seen) == {"moe": 1.0}
    assert prof.kernel_class("_hc_mix_kernel", {}) == {"hyper_connections": 1.0}
    assert prof.kernel_class("_compress_decode_paged_kernel", {}) == {"compressor": 1.0}
    assert prof.kernel_class("Memcpy DtoD (Device -> Device)", seen) == {"unmapped": 1.0}
    assert set(prof.TRITON_KERNEL_CLASSES.values()) <= set(prof.CLASSES)


def test_every_triton_kernel_of_the_v4_path_has_a_class():
    """A new ``@triton.jit`` kernel in the V4 or MoE kernel files must be named in the table, or
    the profile's classes would silently leave it out."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2] / "kernels"
    files = [*root.glob("triton_deepseek_v4_*.py"), root / "triton_moe.py", root / "triton_moe_align.py"]
    launched = set()
    for f in files:
        text = f.read_text()
        for m in re.finditer(r"@triton\.jit\s*\ndef (_\w+_kernel)\(", text):
            launched.add(m.group(1))
    assert launched and launched <= set(prof.TRITON_KERNEL_CLASSES), launched - set(prof.TRITON_KERNEL_CLASSES)


def test_reclassify_puts_the_triton_kernels_of_a_graphs_row_in_their_classes(tmp_path):
    table = [{"kernel": "_w13_swiglu_kernel", "classes": {"unmapped": 1.0}, "us_per_step": 120.0, "calls_per_step": 4.0},
             {"kernel": "gemm_x", "classes": {"projections": 1.0}, "us_per_step": 400.0, "calls_per_step": 30.0},
             {"kernel": "_w2_kernel", "classes": {"unmapped": 1.0}, "us_per_step": 60.0, "calls_per_step": 4.0},
             {"kernel": "Memcpy HtoD (Pinned -> Device)", "classes": {"unmapped": 1.0}, "us_per_step": 2.0,
              "calls_per_step": 1.0}]
    result = {"copy_bandwidth_GBps": 3000.0, "kernel_classes": {"gemm_x": {"projections": 1.0}},
              "environment": {"commit": "abc"},
              "rows": {"scoped-b1": {"bytes": {"moe": 3e8, "projections": 1.2e9}},
                       "graphs-b1": {"kernels": table, "classes": {"unmapped": {"us_per_step": 182.0}}}}}
    src = tmp_path / "in.json"
    src.write_text(json.dumps(result))
    out = prof.reclassify(str(src), str(tmp_path / "out.json"))
    row = out["rows"]["graphs-b1"]
    assert row["classes"]["moe"] == {"us_per_step": 180.0, "kernels_per_step": 8.0}
    assert row["classes"]["unmapped"]["us_per_step"] == 2.0
    assert row["roofline"]["moe"]["roofline_us"] == pytest.approx(100.0)
    assert row["roofline"]["moe"]["pct_of_roofline"] == pytest.approx(100 * 100.0 / 180.0)
    assert out["environment"] == {"commit": "abc"} and out["reclassified_from"] == "in.json"
    assert json.loads((tmp_path / "out.json").read_text())["rows"]["graphs-b1"]["kernels"][0]["classes"] == {"moe": 1.0}

"""The GPU gate's test runner (``bench/gpucheck.py``): a test that ran out of GPU memory beside
others runs once more, alone, at the end, and counts as that run says; every other failure
counts at once."""
from __future__ import annotations

import textwrap

import pytest


def test_a_test_out_of_memory_beside_others_reruns_alone(tmp_path: pytest.TempPathFactory,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import gpucheck
    marker = tmp_path / "ran_once"
    tests = tmp_path / "test_fake_gpu.py"
    tests.write_text(textwrap.dedent(f'''
        import os
        import time


        def test_ok():
            time.sleep(0.5)


        def test_out_of_memory_the_first_time():
            if not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                raise RuntimeError("torch.OutOfMemoryError: CUDA out of memory (stand-in)")


        def test_wrong():
            assert 1 + 1 == 3
    '''))
    names = [f"{tests}::{t}" for t in ("test_ok", "test_out_of_memory_the_first_time", "test_wrong")]
    monkeypatch.setattr(gpucheck, "gpu_test_ids", lambda: list(names))
    log = tmp_path / "tests.log"
    totals = gpucheck.run_gpu_tests(str(tmp_path), timeout_s=120, jobs=3, log=str(log))
    assert totals == {"passed": 2, "failed": 1, "rerun_alone": [names[1]]}
    text = log.read_text()
    assert "out of GPU memory beside other tests (rerun alone)" in text and f"{names[2]}: FAILED" in text
    # alone from the start (one job): an out-of-memory failure is a failure
    marker.unlink()
    assert gpucheck.run_gpu_tests(str(tmp_path), timeout_s=120, jobs=1) == {"passed": 1, "failed": 2}

"""bench/train_draft_head.py reruns end to end (``--tiny``: the embedded SmolLM2 on the CPU, a few
seconds of generation and training) and writes a head the engine loads and drafts with."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test (the GPU runs the real script)")
def test_the_training_script_writes_a_head_the_engine_serves(tmp_path):
    weights, out, data = tmp_path / "head.safetensors", tmp_path / "train.json", tmp_path / "data.pt"
    proc = subprocess.run([sys.executable, "bench/train_draft_head.py", "--tiny", "--weights", str(weights),
                           "--out", str(out), "--data", str(data)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["generation"]["generated_tokens"] > 0 and result["training"]["steps"] >= 1
    assert math.isfinite(result["training"]["loss_first"])
    assert result["eval_teacher_forced"]["held_out_greedy_sequences"] >= 1
    assert data.exists()  # the generated text is kept for a rerun

    from cluster import LLM, SamplingParams
    llm = LLM("smollm2", speculative_method="draft_head", num_speculative_tokens=2, speculative_model=str(weights),
              max_model_len=256)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(outs[0].outputs[0].token_ids) == 8
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.runner.drafter.head.module.metadata["target"] == "SmolLM2-135M-Instruct"

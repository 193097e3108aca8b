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
                           "--out", str(out), "--data", str(data), "--prompt-weight", "0.2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["generation"]["generated_tokens"] > 0 and result["training"]["steps"] >= 1
    assert math.isfinite(result["training"]["loss_first"])
    assert result["eval_teacher_forced"]["held_out_greedy_sequences"] >= 1
    assert data.exists()  # the generated text is kept for a rerun
    bench = result["eval_teacher_forced"]["bench_prompts_answer_tokens_per_step"]
    assert set(bench) == {"trained", "baseline"}  # the committed head, evaluated beside the new one
    for row in bench.values():
        assert {"table_to_json", "summarise", "code_edit", "open_chat"} <= set(row)
        assert all(1.0 <= v <= 4.0 for v in row.values())
    assert bench["baseline"]["mean"] > 1.3  # the committed head drafts these answers (2.1 measured)

    from cluster import LLM, SamplingParams
    llm = LLM("smollm2", speculative_method="draft_head", num_speculative_tokens=2, speculative_model=str(weights),
              max_model_len=256)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(outs[0].outputs[0].token_ids) == 8
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.runner.drafter.head.module.metadata["target"] == "SmolLM2-135M-Instruct"


def test_prompt_positions_weigh_prompt_weight_in_the_loss(tmp_path):
    """Positions predicting a prompt token weigh ``prompt_weight``: 1 is the plain mean, 0 leaves
    the answer positions' loss alone (so a change to the prompt positions' weight moves it)."""
    from bench.train_draft_head import chain_losses
    from cluster import LLM
    from cluster.models.draft_head import LlamaDraftHead
    from tests.factories import make_checkpoint

    make_checkpoint(str(tmp_path), "llama", seed=3)
    target = LLM(str(tmp_path), max_model_len=64).engine.model
    torch.manual_seed(0)
    head = LlamaDraftHead(target.args, target.args.num_layers, torch.float32)
    head.init_from_target(target)
    ids = torch.randint(0, 100, (2, 20))
    lengths, prompts = torch.tensor([20, 14]), torch.tensor([8, 5])
    lm = target.embed_tokens.weight
    with torch.no_grad():
        plain = chain_losses(head, target, lm, ids, lengths, 2, train=False)[0]
        same = chain_losses(head, target, lm, ids, lengths, 2, train=False, prompts=prompts, prompt_weight=1.0)[0]
        answers = chain_losses(head, target, lm, ids, lengths, 2, train=False, prompts=prompts, prompt_weight=0.0)[0]
        # all positions prompt, weight 0: nothing counts
        none = chain_losses(head, target, lm, ids, lengths, 2, train=False, prompts=lengths, prompt_weight=0.0)[0]
        # prompt of 1 token: no position predicts a prompt token, any weight is the plain mean
        ones = chain_losses(head, target, lm, ids, lengths, 2, train=False, prompts=torch.tensor([1, 1]),
                            prompt_weight=0.0)[0]
    assert torch.equal(plain, same) and torch.allclose(plain, ones)
    assert float(none) == 0.0
    assert float(answers) > 0.0 and not torch.allclose(answers, plain)

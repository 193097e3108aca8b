"""DeepSeek-V4's MTP layer (``speculative_method=mtp``) against a reference assembled from
transformers' V4 blocks (transformers has no MTP module): a one-layer transformers V4 model on the
sliding-window path with learned routing, loaded with the ``mtp.0.*`` weights, its hyper head and
norm the MTP's; ``enorm``/``hnorm`` transformers' RMSNorm; the MTP input as DeepSeek's reference
builds it, ``e_proj(enorm(embed(x_{p+1}))) + h_proj(hnorm(h_p))`` over the target's pre-head
streams ``h_p`` (read from transformers' own last decoder layer). The engine's MTP rows sit one
position later (its row at q reads x_q and the streams at q - 1) with attention from position 1:
its logits equal the reference's, teacher-forced (every position) and chained (the layer's own
output streams in place of the target's, as drafting chains it)."""
from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from cluster.engine.request import Request
from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.deepseek_factories import SWA, make_v4_checkpoint, random_mtp_tensors, v4_config
from tests.factories import mixed_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def add_mtp(path: str, config: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Write an MTP layer (random, released layout) into the checkpoint at ``path``."""
    file = glob.glob(os.path.join(path, "*.safetensors"))[0]
    tensors = load_file(file)
    mtp = random_mtp_tensors(config, seed)
    tensors.update(mtp)
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        text = f.read()
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(text.replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1'))
    return mtp


def transformers_mtp_layer(tmp: str, name: str, main_tensors: dict[str, torch.Tensor],
                           mtp: dict[str, torch.Tensor]):
    """A one-layer transformers V4 model (sliding window, learned routing) holding the MTP
    layer's block, hyper head and norm, and the main model's embedding and head."""
    import transformers
    config = v4_config(name, num_hidden_layers=1, layer_types=[SWA], mlp_layer_types=["moe"])
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(tmp)
    file = glob.glob(os.path.join(tmp, "*.safetensors"))[0]
    tensors = load_file(file)
    for key in list(tensors):
        if key.startswith("model.layers.0."):
            source = "mtp.0." + key.removeprefix("model.layers.0.").replace("attn.norm.", "attn.kv_norm.")
            tensors[key] = mtp[source]
    tensors |= {"model.hc_head.hc_fn": mtp["mtp.0.hc_head_fn"], "model.hc_head.hc_base": mtp["mtp.0.hc_head_base"],
                "model.hc_head.hc_scale": mtp["mtp.0.hc_head_scale"], "model.norm.weight": mtp["mtp.0.norm.weight"],
                "model.embed_tokens.weight": main_tensors["model.embed_tokens.weight"],
                "head.weight": main_tensors["head.weight"]}
    save_file(tensors, file, metadata={"format": "pt"})
    return transformers.DeepseekV4ForCausalLM.from_pretrained(tmp).float().eval()


class Reference:
    """The MTP layer in the reference's convention (row p: token x_{p+1}, the streams at p)."""

    def __init__(self, layer_model, mtp: dict[str, torch.Tensor], eps: float) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm
        self.model = layer_model
        hidden = mtp["mtp.0.e_proj.weight"].shape[0]
        self.enorm, self.hnorm = DeepseekV4RMSNorm(hidden, eps), DeepseekV4RMSNorm(hidden, eps)
        with torch.no_grad():
            self.enorm.weight.copy_(mtp["mtp.0.enorm.weight"])
            self.hnorm.weight.copy_(mtp["mtp.0.hnorm.weight"])
        self.e_proj, self.h_proj = mtp["mtp.0.e_proj.weight"], mtp["mtp.0.h_proj.weight"]

    @torch.no_grad()
    def streams(self, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Rows of tokens ``[L]`` with the streams one position earlier ``[L, hc, D]`` ->
        the layer's output streams ``[L, hc, D]``, each row attending the rows before it."""
        from transformers.masking_utils import create_sliding_window_causal_mask
        inner = self.model.model
        e = torch.nn.functional.linear(self.enorm(inner.embed_tokens(tokens[None])), self.e_proj)  # [1, L, D]
        x = (torch.nn.functional.linear(self.hnorm(prev[None]), self.h_proj) + e.unsqueeze(2)).contiguous()
        positions = torch.arange(tokens.shape[0])[None]
        mask = create_sliding_window_causal_mask(config=inner.config, inputs_embeds=x[:, :, 0], attention_mask=None,
                                                 cache=None, position_ids=positions)
        rope = {kind: inner.rotary_emb(x[:, :, 0], position_ids=positions, layer_type=kind)
                for kind in ("main", "compress")}
        return inner.layers[0](x, position_embeddings=rope, position_ids=positions, attention_mask=mask,
                               input_ids=tokens[None])[0]

    @torch.no_grad()
    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(self.model.model.hc_head(streams[None])))[0].float()


@pytest.fixture(scope="module", params=["csa_hca", "hca_csa"])
def setup(request, tmp_path_factory, one_thread):
    name = request.param
    path = str(tmp_path_factory.mktemp(f"{name}_mtp"))
    hf = make_v4_checkpoint(path, name)
    main_tensors = load_file(glob.glob(os.path.join(path, "*.safetensors"))[0])
    mtp = add_mtp(path, hf.config.to_dict())
    layer_model = transformers_mtp_layer(str(tmp_path_factory.mktemp(f"{name}_ref")), name, main_tensors, mtp)
    return name, path, hf, Reference(layer_model, mtp, hf.config.rms_norm_eps)


@torch.no_grad()
def target_streams(hf, ids: list[int]) -> torch.Tensor:
    """transformers' pre-head streams ``[L, hc, D]``: its last decoder layer's output."""
    captured = {}
    handle = hf.model.layers[-1].register_forward_hook(lambda m, i, out: captured.setdefault("x", out))
    hf(torch.tensor([ids]))
    handle.remove()
    return captured["x"][0].float()


def test_mtp_logits_equal_the_transformers_reference_teacher_forced_and_chained(setup):
    name, path, hf, ref = setup
    llm = LLM(path, block_size=4, speculative_method="mtp", num_speculative_tokens=2)
    engine, drafter = llm.engine, llm.engine.runner.drafter
    ids = mixed_prompts(512, (29,), seed=5)[0]
    n = len(ids)
    # the engine's target: its forward returns the pre-head streams; they equal transformers'
    request = Request("probe", ids, SamplingParams())
    assert engine.kv.allocate("probe", n)
    tables = engine.kv.block_tables("probe")
    sched = SchedulerOutput([ScheduledRequest(request, 0, n, "probe", ids)], {"probe": tables})
    with torch.no_grad():
        streams, _ = engine.runner.forward(sched)  # [n, hc * D]
    want_streams = target_streams(hf, ids)
    torch.testing.assert_close(streams.view_as(want_streams), want_streams, rtol=1e-4, atol=1e-4)
    table = tables[0]
    tokens = torch.tensor(ids)
    # teacher-forced: engine rows 1..n-1 (x_q, streams at q - 1) = reference rows 0..n-2
    first = drafter._pass([(1, n - 1, table)], tokens[1:], streams[:-1])  # [n - 1, hc * D]
    want = ref.streams(tokens[1:], want_streams[:-1])
    scale = want.abs().max().item()
    torch.testing.assert_close(first.view_as(want), want, rtol=0, atol=1e-4 * scale)
    logits, want_logits = drafter.head.draft_logits(first), ref.logits(want)
    spread = (want_logits.max() - want_logits.min()).item()
    assert (logits - want_logits).abs().max().item() < 1e-4 * spread
    assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
    # chained: at q the layer reads its own output streams at q - 1 in place of the target's
    for q in (2, 9, 17, n - 1):
        drafter._pass([(1, q - 1, table)], tokens[1:q], streams[:q - 1])  # the rows before q, from the target
        chained = drafter._pass([(q, 1, table)], tokens[q:q + 1], first[q - 2:q - 1])
        prev = torch.cat([want_streams[:q - 1], want[q - 2:q - 1]])  # reference rows 0..q-1
        want_q = ref.streams(tokens[1:q + 1], prev)[-1:]
        got_logits, want_q_logits = drafter.head.draft_logits(chained), ref.logits(want_q)
        assert (got_logits - want_q_logits).abs().max().item() < 1e-4 * spread, q
        assert torch.equal(got_logits.argmax(-1), want_q_logits.argmax(-1)), q
    engine.kv.free("probe")

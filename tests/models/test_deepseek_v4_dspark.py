"""DeepSeek-V4's DSpark drafter (``speculative_method=dspark``) on small random V4 configurations.

- Its config and weights load by name and shape (``dspark_*`` keys; ``mtp.<s>.*``; stage 0's
  ``main_proj``/``main_norm``; the last stage's hyper head, norm, Markov and confidence heads), with
  the stage count taken from the config, not ``num_nextn_predict_layers``; what does not fit stops
  loading by name.
- A block's logits (Markov-corrected), drafts and confidence logits equal a reference assembled
  from transformers' V4 blocks: the target's features captured from transformers' own decoder
  layers (the mean of each target layer's output streams), then per stage a one-layer
  transformers V4 model loaded with that stage's weights, whose attention (transformers' own
  projections, norms, RoPE, sinks and grouped output) runs over the stage's context rows
  (``main_x`` at positions P - window .. P - 1) followed by the block's rows, every block row
  seeing every row; the heads as DeepSeek's reference defines them (``z_i = U_i + W2 W1[y_{i-1}]``,
  ``c_i = proj([g_i, W1[y_{i-1}]])``).
- Greedy output with DSpark equals decoding without it, token for token, whatever the drafts:
  its own, and drafts right for the first 0..5 of every block (rejections at every offset),
  across window and block boundaries, chunked prefill, preemption and prefix hits; seeded
  sampling and ``n > 1`` equal; the confidence stop shortens what is verified, never the output;
  no block leaked.
- The drafter's state after rejections is exact: every block drafted during speculative decoding
  (logits and all) equals the block drafted from a one-pass prefill of the same tokens.
"""
from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from cluster.common.errors import ModelLoadError, UnsupportedArchitectureError, UnsupportedSettingError
from cluster.config import ModelConfig
from cluster.engine.cuda_graphs import GraphUnsafeError
from cluster.engine.request import Request
from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.deepseek_factories import SWA, add_dspark, copy_checkpoint, edit_config, edit_tensors, \
    make_v4_checkpoint, v4_config
from tests.factories import generate_disaggregated, local_pd_workers, mixed_prompts, output_summary, run_with_aborts

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 5
TARGETS = [1, 2, 3]
PROMPTS = mixed_prompts(512, (3, 9, 17, 26, 33), seed=7)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    path = str(tmp_path_factory.mktemp("dspark"))
    hf = make_v4_checkpoint(path, "csa_hca")
    tensors = add_dspark(path, hf.config.to_dict(), TARGETS, block=BLOCK)
    return path, hf, tensors


@pytest.fixture(scope="module")
def v4(setup):
    return setup[0]


def greedy(n: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def dspark_llm(path: str, **kwargs) -> LLM:
    return LLM(path, block_size=4, speculative_method="dspark", num_speculative_tokens=BLOCK, **kwargs)


# --- config and weights ------------------------------------------------------------------------


def test_config_gives_the_stages_not_num_nextn_predict_layers(v4):
    from cluster.models.deepseek_v4_config import DeepseekV4Args
    from cluster.models.registry import read_config
    config = read_config(v4)
    assert config["num_nextn_predict_layers"] == 1  # as the released 0731 config says, for 3 stages
    args = DeepseekV4Args.from_hf(config)
    assert args.dspark is not None and args.dspark.num_stages == 3 and args.mtp_layer_types == ()
    assert args.dspark.target_layer_ids == tuple(TARGETS) and args.dspark.block_size == BLOCK
    assert DeepseekV4Args.from_hf({**config, "n_mtp_layers": 2}).dspark.num_stages == 2
    n = config["num_hidden_layers"]
    released = {**config, "layer_types": None, "compress_ratios": [0, 4, 8, 4] + [0] * 3}
    assert DeepseekV4Args.from_hf(released).dspark.num_stages == 3  # one entry per stage past the layers
    for bad, words in (({"dspark_target_layer_ids": [n]}, "dspark_target_layer_ids"),
                       ({"dspark_markov_rank": None}, "dspark_markov_rank"),
                       ({"dspark_noise_token_id": 10 ** 6}, "dspark_noise_token_id"),
                       ({"layer_types": None, "compress_ratios": [0, 4, 8, 4, 4, 0, 0]}, "sliding window only")):
        with pytest.raises(UnsupportedArchitectureError, match=words):
            DeepseekV4Args.from_hf({**config, **bad})


def test_weights_load_by_name_and_shape(v4, setup, tmp_path):
    llm = dspark_llm(v4)
    model = llm.engine.model
    _, _, tensors = setup
    assert len(model.mtp) == 3 and model.dspark is not None
    params = dict(model.named_parameters())
    for name in ("mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight", "mtp.2.confidence_head.proj.weight",
                 "mtp.1.attn.wkv.weight", "mtp.2.hc_head_fn"):
        torch.testing.assert_close(params[name].float(), tensors[name].float())
    assert "mtp.1.main_proj.weight" not in params and "mtp.0.markov_head.markov_w1.weight" not in params
    rows = {r["component"]: r for r in llm.engine.backends()}
    assert rows["speculative_decoding"]["impl"] == "dspark" and rows["mtp.moe"]["role"] == "draft"
    # a missing stage tensor, one stage too many, a wrong shape: each stops loading by name
    for edit, words in ((lambda t: t.pop("mtp.2.markov_head.markov_w2.weight"), "mtp.2.markov_head.markov_w2"),
                        (lambda t: t.update({"mtp.3.attn_norm.weight": t["mtp.0.attn_norm.weight"].clone()}), "mtp.3"),
                        (lambda t: t.update({"mtp.0.main_proj.weight": t["mtp.0.main_proj.weight"][:, :64].clone()}),
                         "mtp.0.main_proj.weight")):
        bad = copy_checkpoint(v4, str(tmp_path / f"bad{len(os.listdir(tmp_path))}"))
        edit_tensors(bad, edit)
        with pytest.raises(ModelLoadError, match=words.replace(".", r"\.")):
            dspark_llm(bad)


def test_settings_that_do_not_fit_are_refused(v4, tmp_path):
    with pytest.raises(UnsupportedSettingError, match="dspark_block_size"):
        LLM(v4, block_size=4, speculative_method="dspark", num_speculative_tokens=BLOCK + 1)
    with pytest.raises(UnsupportedSettingError, match="use speculative_method='dspark'"):
        LLM(v4, block_size=4, speculative_method="mtp", num_speculative_tokens=2)
    plain = copy_checkpoint(v4, str(tmp_path / "plain"))
    edit_config(plain, lambda c: c.pop("dspark_block_size"))
    edit_tensors(plain, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]])
    with pytest.raises(UnsupportedSettingError, match="needs a DSpark checkpoint"):
        LLM(plain, block_size=4, speculative_method="dspark", num_speculative_tokens=2)
    with pytest.raises(UnsupportedSettingError, match="dspark_confidence_threshold"):
        LLM(v4, speculative_method="dspark", dspark_confidence_threshold=1.5)


# --- the block against transformers ------------------------------------------------------------


def transformers_stage(tmp: str, tensors: dict[str, torch.Tensor], stage: int, main: dict[str, torch.Tensor]):
    """A one-layer transformers V4 model (sliding window, learned routing, eager attention) holding
    stage ``stage``'s block, its hyper head and norm the stage's where it has them."""
    import transformers
    config = v4_config("csa_hca", num_hidden_layers=1, layer_types=[SWA], mlp_layer_types=["moe"])
    transformers.DeepseekV4ForCausalLM(config).save_pretrained(tmp)
    file = glob.glob(os.path.join(tmp, "*.safetensors"))[0]
    saved = load_file(file)
    prefix = f"mtp.{stage}."
    for key in list(saved):
        if key.startswith("model.layers.0."):
            saved[key] = tensors[prefix + key.removeprefix("model.layers.0.").replace("attn.norm.", "attn.kv_norm.")]
    if prefix + "norm.weight" in tensors:
        saved |= {"model.hc_head.hc_fn": tensors[prefix + "hc_head_fn"],
                  "model.hc_head.hc_base": tensors[prefix + "hc_head_base"],
                  "model.hc_head.hc_scale": tensors[prefix + "hc_head_scale"],
                  "model.norm.weight": tensors[prefix + "norm.weight"]}
    saved |= {"model.embed_tokens.weight": main["model.embed_tokens.weight"], "head.weight": main["head.weight"]}
    save_file(saved, file, metadata={"format": "pt"})
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp, attn_implementation="eager").float().eval()
    return model


class Reference:
    def __init__(self, hf, stages, tensors: dict[str, torch.Tensor], noise: int, window: int) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm
        self.hf, self.stages, self.t, self.noise, self.window = hf, stages, tensors, noise, window
        hidden = hf.config.hidden_size
        self.main_norm = DeepseekV4RMSNorm(hidden, hf.config.rms_norm_eps)
        with torch.no_grad():
            self.main_norm.weight.copy_(tensors["mtp.0.main_norm.weight"])

    @torch.no_grad()
    def main_x(self, ids: list[int]) -> torch.Tensor:
        """transformers' decoder layers' output streams at the target layers, each the mean of
        its streams, through main_proj and main_norm -> ``[L, hidden]``."""
        captured = {}
        def hook(i):
            def record(module, inputs, out):
                captured[i] = out[0].mean(1)  # [L, hc, D] -> [L, D]
            return record
        hooks = [self.hf.model.layers[i].register_forward_hook(hook(i)) for i in TARGETS]
        self.hf(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        features = torch.cat([captured[i] for i in TARGETS], -1)
        return self.main_norm(torch.nn.functional.linear(features, self.t["mtp.0.main_proj.weight"]))

    @torch.no_grad()
    def block(self, main_x: torch.Tensor, anchor: int, position: int, prev: list[int]):
        """(Markov-corrected logits ``[B, V]``, confidence logits ``[B]``) of the block at
        ``position``, with ``prev`` the tokens before each row's draft (the anchor, then the drafts)."""
        first = max(0, position - self.window)
        context = main_x[first:position]
        ctx_pos = torch.arange(first, position)
        blk_pos = torch.arange(position, position + BLOCK)
        tokens = torch.tensor([[anchor] + [self.noise] * (BLOCK - 1)])
        x = self.hf.model.embed_tokens(tokens).unsqueeze(2).expand(-1, -1, self.hf.config.hc_mult, -1).contiguous()
        for model in self.stages:
            inner = model.model
            layer, attn = inner.layers[0], inner.layers[0].self_attn
            original = attn.forward

            def forward(hidden_states, *args, original=original, inner=inner, **kwargs):
                full = torch.cat([context[None], hidden_states], 1)
                pos = torch.cat([ctx_pos, blk_pos])[None]
                rope = {kind: inner.rotary_emb(full, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
                mask = torch.zeros(1, 1, full.shape[1], full.shape[1])  # every row sees every row
                out, w = original(full, rope, pos, mask)
                return out[:, context.shape[0]:], w
            attn.forward = forward
            try:
                x = layer(x, input_ids=tokens)
            finally:
                attn.forward = original
        last = self.stages[-1].model
        g = last.hc_head(x)[0]  # [B, hidden]
        base = self.hf.lm_head(last.norm(g)).float()
        w1, w2 = self.t["mtp.2.markov_head.markov_w1.weight"], self.t["mtp.2.markov_head.markov_w2.weight"]
        e = w1[torch.tensor(prev)]
        z = base + e @ w2.t()
        conf = torch.cat([g, e], -1) @ self.t["mtp.2.confidence_head.proj.weight"][0]
        return z, conf


def test_block_logits_drafts_and_confidence_equal_the_transformers_reference(setup, tmp_path_factory):
    path, hf, tensors = setup
    main = load_file(glob.glob(os.path.join(path, "*.safetensors"))[0])
    stages = [transformers_stage(str(tmp_path_factory.mktemp(f"stage{s}")), tensors, s, main) for s in range(3)]
    ref = Reference(hf, stages, tensors, noise=7, window=hf.config.sliding_window)
    llm = dspark_llm(path)
    engine, runner = llm.engine, llm.engine.runner.drafter
    ids = mixed_prompts(512, (29,), seed=5)[0]
    main_x = ref.main_x(ids)
    request = Request("probe", ids, SamplingParams())
    assert engine.kv.allocate("probe", len(ids) + BLOCK)
    tables = engine.kv.block_tables("probe")
    sched = SchedulerOutput([ScheduledRequest(request, 0, len(ids), "probe", ids)], {"probe": tables})
    with torch.no_grad():
        engine.runner.forward(sched)  # writes the stages' context entries
    table = torch.tensor([tables[0]])
    model = engine.model
    checked = 0
    # blocks at the prompt's end (window full) and inside it (window not yet full: position < 8)
    for position in (len(ids) - 1, 12, 5):
        anchor = ids[position]
        with torch.no_grad():
            drafts, logits, conf = runner.drafter.draft_block(
                model.embed, model.head_logits, model.rope, engine.runner.kv_caches, table,
                torch.tensor([anchor]), torch.tensor([position]))
        prev = [anchor] + drafts[0, :-1].tolist()
        want_z, want_c = ref.block(main_x, anchor, position, prev)
        scale = want_z.abs().max().item()
        torch.testing.assert_close(logits[0], want_z, rtol=0, atol=2e-4 * scale)
        torch.testing.assert_close(conf[0], want_c, rtol=1e-4, atol=1e-4 * want_c.abs().max().item())
        assert drafts[0].tolist() == want_z.argmax(-1).tolist()
        checked += 1
    assert checked == 3


# --- output and state through the engine ------------------------------------------------------


def test_greedy_seeded_and_n_output_equal_no_speculation(v4):
    params = [greedy(30), SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, n=2),
              greedy(7), SamplingParams(temperature=0.0, max_tokens=25, n=2, ignore_eos=True), greedy(33)]
    want = output_summary(LLM(v4, block_size=4, max_num_batched_tokens=16).generate(PROMPTS, params))
    llm = dspark_llm(v4, max_num_batched_tokens=16)
    assert output_summary(llm.generate(PROMPTS, params)) == want
    engine = llm.engine
    assert engine.spec_stats.num_drafts > 20 and engine.runner.drafter.num_blocks > 5
    assert engine.spec_stats.num_draft_tokens > 4 * engine.spec_stats.num_drafts  # whole blocks verified
    assert engine.kv.usage == 0.0
    assert engine.runner.drafter.counters()["dspark_blocks_total"] > 5


class Scripted:
    """Wraps the runner's proposal: records each block (the context tokens, its drafts and its
    logits), then replaces its drafts by the reference output for the first ``right`` of them
    and wrong tokens after (None: the drafter's own)."""

    def __init__(self, engine, reference: dict[tuple[int, ...], list[int]], right: int | None) -> None:
        self.engine, self.reference, self.right = engine, reference, right
        self.runner = engine.runner.drafter
        self.records: list[tuple[list[int], list[int], torch.Tensor]] = []
        self.original_block = self.runner.drafter.draft_block
        self.original_propose = self.runner.propose
        self.runner.drafter.draft_block = self.block
        self.runner.propose = self.propose
        self.last = None

    def undo(self) -> None:
        """Unwrap the runner (the wrappers refer back to it: a cycle that keeps the engine's KV
        cache alive until a full collection)."""
        del self.runner.drafter.draft_block, self.runner.propose

    def block(self, *args):
        self.last = self.original_block(*args)
        return self.last

    def propose(self, jobs, block_tables):
        out = self.original_propose(jobs, block_tables)
        drafts, logits, _ = self.last
        for i, job in enumerate(jobs):
            r = self.engine.scheduler.requests[job.request_id]
            tokens = list(r.all_token_ids)
            self.records.append((tokens, drafts[i].tolist(), logits[i].clone()))
            if self.right is not None:
                ref = self.reference[tuple(r.prompt_token_ids)]
                done = r.num_output_tokens
                truth = ref[done:done + job.num_tokens]
                m = min(self.right, len(truth))
                out[job.request_id] = truth[:m] + [(t + 1) % 512 for t in truth[m:]]
        return out


@pytest.mark.parametrize("case", ["plain", "chunked", "preempting"])
def test_output_is_unchanged_with_rejections_at_every_offset_and_state_is_exact(v4, case):
    settings = {"plain": {}, "chunked": {"max_num_batched_tokens": 8},
                "preempting": {"num_kv_blocks": 40, "max_num_batched_tokens": 32}}[case]
    prompts = PROMPTS + [PROMPTS[3][:16] + [5, 6, 7]]  # a prefix hit on a prompt's blocks
    base = LLM(v4, block_size=4, **settings)
    results = base.generate(prompts, greedy())
    want = output_summary(results)
    reference = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, results)}
    records = []
    for right in (None, 0, 1, 2, 3, 4, 5) if case == "plain" else (None, 0, 2, 5):
        llm = dspark_llm(v4, **settings)
        script = Scripted(llm.engine, reference, right)
        assert output_summary(llm.generate(prompts, greedy())) == want, right
        stats = llm.engine.spec_stats
        assert stats.num_drafts > 10 and llm.engine.kv.usage == 0.0
        if right is not None:
            assert stats.accepted_per_pos[right:] == [0] * (BLOCK - right)
            assert all(n > 0 for n in stats.accepted_per_pos[:right])  # a rejection at offset ``right``
        if case == "preempting":
            assert llm.engine.scheduler.num_preemptions > 0
        records += script.records[::7]
        script.undo()
    # every block drafted after rejections equals the block drafted from a one-pass prefill
    fresh = dspark_llm(v4, enable_prefix_caching=False)
    engine, runner = fresh.engine, fresh.engine.runner.drafter
    model = engine.model
    assert len(records) > 40
    for n, (tokens, drafts, logits) in enumerate(records):
        rid = f"check{n}"
        context, anchor = tokens[:-1], tokens[-1]
        assert engine.kv.allocate(rid, len(tokens) + BLOCK)
        tables = engine.kv.block_tables(rid)
        sched = SchedulerOutput([ScheduledRequest(Request(rid, context, SamplingParams()), 0, len(context), rid,
                                                  context)], {rid: tables})
        with torch.no_grad():
            engine.runner.forward(sched)
            got, got_logits, _ = runner.drafter.draft_block(
                model.embed, model.head_logits, model.rope, engine.runner.kv_caches, torch.tensor([tables[0]]),
                torch.tensor([anchor]), torch.tensor([len(context)]))
        engine.kv.free(rid)
        assert got[0].tolist() == drafts, n
        torch.testing.assert_close(got_logits[0], logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())


def test_confidence_stop_shortens_what_is_verified_never_the_output(v4):
    want = output_summary(LLM(v4, block_size=4).generate(PROMPTS, greedy()))
    full = dspark_llm(v4)
    assert output_summary(full.generate(PROMPTS, greedy())) == want
    cut = dspark_llm(v4, dspark_confidence_threshold=0.5)
    assert output_summary(cut.generate(PROMPTS, greedy())) == want
    runner = cut.engine.runner.drafter
    assert runner.num_early_stops > 0
    assert cut.engine.spec_stats.num_draft_tokens < full.engine.spec_stats.num_draft_tokens
    assert cut.engine.kv.usage == 0.0


def test_aborts_free_every_block(v4):
    llm = dspark_llm(v4, max_num_batched_tokens=24)
    run_with_aborts(llm.engine, PROMPTS, requests=80)
    assert llm.engine.kv.usage == 0.0 and not llm.engine.runner.drafter.disabled


def graph_and_eager_blocks(engine, prompts):
    """Each prompt but its last token prefilled as a request of its own, then the blocks anchored
    at those last tokens drafted by the engine's block graphs and eagerly: ``((drafts, confidence)
    from the graph, (drafts, confidence) eager)``; the requests are freed."""
    runner, model, dev = engine.runner.drafter, engine.model, engine.device
    tables, anchors, positions = [], [], []
    for n, prompt in enumerate(prompts):
        rid, context = f"direct{n}", prompt[:-1]
        assert engine.kv.allocate(rid, len(prompt) + BLOCK)
        table = engine.kv.block_tables(rid)
        sched = SchedulerOutput([ScheduledRequest(Request(rid, context, SamplingParams()), 0, len(context), rid,
                                                  context)], {rid: table})
        with torch.inference_mode():
            engine.runner.forward(sched)
        tables.append(table[0])
        anchors.append(prompt[-1])
        positions.append(len(context))
    graph = runner.block_graphs.run(tables, anchors, positions)
    width = max(len(t) for t in tables)
    with torch.inference_mode():
        drafts, _, confidence = runner.drafter.draft_block(
            model.embed, model.head_logits, model.rope, engine.runner.kv_caches,
            torch.tensor([t + [0] * (width - len(t)) for t in tables], device=dev),
            torch.tensor(anchors, device=dev), torch.tensor(positions, device=dev))
    for n in range(len(prompts)):
        engine.kv.free(f"direct{n}")
    return graph, (drafts, confidence)


def test_block_graphs_turned_off_say_so(v4):
    """The block graphs are on by default (``dspark_cuda_graphs``); turned off, nothing is captured
    even where it could be, and ``/v1/backends`` says why."""
    assert ModelConfig(model=v4).dspark_cuda_graphs
    llm = dspark_llm(v4, dspark_cuda_graphs=False)
    llm.engine._capture_draft_graphs(emulate=True)
    runner = llm.engine.runner.drafter
    assert runner.block_graphs is None and "dspark_cuda_graphs is off" in runner.graph_status.reason
    row = next(r for r in llm.engine.backends() if r["component"] == "dspark")
    assert row["impl"] == "eager" and "dspark_cuda_graphs is off" in row["reason"]


def test_blocks_replayed_from_emulated_cuda_graphs_equal_the_eager_blocks(v4):
    """DSpark's blocks in (emulated) CUDA graphs: three requests padded into the graph of four
    draft the eager block's drafts and confidence; served, greedy, seeded and ``n > 1`` output
    equals no speculation with every block from a graph; a graph that froze its inputs is refused
    by the self-check."""
    params = [greedy(30), SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, n=2),
              greedy(7), SamplingParams(temperature=0.0, max_tokens=25, n=2, ignore_eos=True), greedy(33)]
    want = output_summary(LLM(v4, block_size=4, max_num_batched_tokens=16).generate(PROMPTS, params))
    # the MoE's Triton kernels (interpreted): the reference MoE groups rows on the host
    llm = dspark_llm(v4, max_num_batched_tokens=16, max_num_seqs=4, moe_backend="triton", draft_moe_backend="triton")
    engine = llm.engine
    engine._capture_draft_graphs(emulate=True)
    runner = engine.runner.drafter
    graphs = runner.block_graphs
    assert runner.graph_status.captured and graphs is not None and graphs.sizes == [1, 2, 4]
    row = next(r for r in engine.backends() if r["component"] == "dspark")
    assert row["impl"] == "graph" and "replays a CUDA graph, captured: batch sizes 1, 2, 4" in row["reason"]
    (got, got_conf), (drafts, confidence) = graph_and_eager_blocks(engine, PROMPTS[1:4])
    assert got.tolist() == drafts.tolist()
    torch.testing.assert_close(got_conf, confidence, rtol=1e-4, atol=1e-4)
    # served: every block from a graph, output unchanged
    assert output_summary(llm.generate(PROMPTS, params)) == want
    assert runner.num_graph_blocks > 5 and runner.num_eager_blocks == 0
    assert runner.counters()["dspark_graph_blocks_total"] == runner.num_graph_blocks
    assert engine.kv.usage == 0.0
    assert engine.runner.verify_graphs is None  # DSpark's verify steps stay synchronous

    class Frozen:
        def __init__(self) -> None:
            self.output = tuple(t.clone() for t in graphs.forward(4))

        def replay(self) -> None:
            graphs.outputs[4] = self.output
    graphs.graphs[4] = Frozen()
    with pytest.raises(GraphUnsafeError, match="batch 4"):
        graphs.verify()
    assert int(graphs.tables.abs().sum()) == 0  # the placeholders are back


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_blocks_replayed_from_cuda_graphs_on_the_gpu(v4):
    """On a GPU (bfloat16): DSpark's blocks replay captured CUDA graphs, which draft the eager
    block's tokens for three requests padded into the graph of four; served, the output equals
    DSpark's with everything eager, token for token, every block from a graph."""
    common = dict(block_size=16, max_num_seqs=4, max_model_len=256, dtype="bfloat16", speculative_method="dspark",
                  num_speculative_tokens=BLOCK)  # block graphs: the default
    prompts = PROMPTS[:3]
    want = output_summary(LLM(v4, enforce_eager=True, **common).generate(prompts, greedy(24)))
    llm = LLM(v4, **common)
    engine = llm.engine
    runner = engine.runner.drafter
    graphs = runner.block_graphs
    assert runner.graph_status.captured and graphs is not None and graphs.sizes == [1, 2, 4], runner.graph_status
    assert output_summary(llm.generate(prompts, greedy(24))) == want
    assert runner.num_graph_blocks > 5 and runner.num_eager_blocks == 0
    assert engine.kv.usage == 0.0
    (got, got_conf), (drafts, confidence) = graph_and_eager_blocks(engine, prompts)
    assert float((got == drafts).float().mean()) >= 0.9  # bf16 rounding may flip a near-tie
    torch.testing.assert_close(got_conf, confidence, rtol=5e-2, atol=5e-2)


# --- disaggregated ------------------------------------------------------------------------------


def run_disaggregated(v4: str, prompts, params, tamper=None):
    """Generate through a prefill worker and a decode worker (``local`` transfer); ``tamper(blob)``
    edits each hand-over on its way. Returns (outputs, decode engine, prefill engine, the prompt
    positions decode computed)."""
    def wrap(prefill_fn):
        async def tampered(*args, **kwargs):
            result = await prefill_fn(*args, **kwargs)
            if tamper is not None and getattr(result, "draft_hidden", None) is not None:
                result.draft_hidden = tamper(result.draft_hidden)
            return result
        return tampered
    prompt_rows: list[int] = []
    with local_pd_workers({"model": v4, "block_size": 4, "max_num_batched_tokens": 16, "speculative_method": "dspark",
                           "num_speculative_tokens": BLOCK, "enable_prefix_caching": False}, wrap) as (prefill, decode):
        engine = decode.engine.engine
        execute = engine.runner.execute

        def spy(sched):
            for s in sched.scheduled:
                prompt_rows.append(max(0, s.request.num_prompt_tokens - s.num_computed_tokens))
            return execute(sched)
        engine.runner.execute = spy
        try:
            got = generate_disaggregated(decode, prompts, params)
        finally:
            del engine.runner.execute  # the spy refers back to the runner: a cycle
    return got, engine, prefill.engine.engine, prompt_rows


def test_prefill_hands_the_drafter_state_to_decode_which_recomputes_nothing(v4):
    params = greedy(20)
    got, engine, prefill_engine, prompt_rows = run_disaggregated(v4, PROMPTS, params)
    assert got == [o.outputs[0].token_ids for o in LLM(v4, block_size=4).generate(PROMPTS, params)]
    runner = engine.runner.drafter
    assert runner.num_handovers_checked == len(PROMPTS) and runner.num_handovers_rejected == 0
    assert sum(prompt_rows) == 0  # decode computed no prompt position: the entries came with the blocks
    assert engine.spec_stats.num_drafts > 10 and runner.num_blocks > 5
    assert prefill_engine.spec_stats is None  # prefill replicas never draft
    assert engine.kv.usage == 0.0


@pytest.mark.parametrize("tamper", ["checksum", "layout", "missing"])
def test_a_hand_over_that_does_not_match_turns_drafting_off_loudly_and_output_stays_exact(v4, tamper, caplog):
    import json

    def edit(blob):
        if tamper == "missing":
            return None
        d = json.loads(blob)
        if tamper == "checksum":
            d["crc32"] ^= 1
        else:
            d["window"] += 1
        return json.dumps(d).encode()
    params = greedy(12)
    got, engine, _, _ = run_disaggregated(v4, PROMPTS[:3], params, tamper=edit)
    assert got == [o.outputs[0].token_ids for o in LLM(v4, block_size=4).generate(PROMPTS[:3], params)]
    runner = engine.runner.drafter
    assert runner.num_handovers_rejected == 3 and runner.num_blocks == 0  # nothing drafted from unchecked state
    words = {"checksum": "checksum", "layout": "window", "missing": "no DSpark state"}[tamper]
    assert any("hand-over" in r.message and words in r.message for r in caplog.records)
    assert engine.kv.usage == 0.0 and not runner.disabled


def test_the_released_0731_config_parses_to_three_stages_and_their_kv():
    """DeepSeek-V4-Flash-0731's config.json: 43 layers, ``compress_ratios`` with three trailing
    zeros for the stages, ``num_nextn_predict_layers`` 1, features of layers 40-42, blocks of 5.
    Three sliding stages (no MTP layer), the draft MoE row in the draft's expert format, and
    three more layers in the window group, kept one position longer."""
    from cluster.models.deepseek_v4 import DeepseekV4ForCausalLM, kernel_components
    from cluster.models.deepseek_v4_config import DeepseekV4Args
    from tests.deepseek_factories import V4_FLASH_CONFIG
    config = {**V4_FLASH_CONFIG, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
              "dspark_block_size": 5, "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256,
              "dspark_noise_token_id": 128799}
    args = DeepseekV4Args.from_hf(config)
    assert args.num_layers == 43 and args.mtp_layer_types == ()
    assert args.dspark is not None and args.dspark.num_stages == 3 and args.dspark.target_layer_ids == (40, 41, 42)
    rows = {c[0]: c for c in kernel_components(config)}
    assert rows["mtp.moe"][2:] == ("mxfp4", "draft")  # expert_dtype fp4: the stages' experts too
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(args, torch.bfloat16, dspark=True)
    swa = model.kv_cache_specs(256, "bfloat16")[0]
    assert swa.num_layers == 43 + 3 and swa.sliding_window == 129
    assert [type(s).__name__ for s in model.mtp] == ["DSparkStage"] * 3
    assert tuple(model.mtp[0].main_proj.weight.shape) == (4096, 3 * 4096)
    assert tuple(model.mtp[2].markov_head.markov_w2.weight.shape) == (129280, 256)
    assert tuple(model.mtp[2].confidence_head.proj.weight.shape) == (1, 4096 + 256)
    assert not hasattr(model.mtp[1], "markov_head") and not hasattr(model.mtp[1], "main_proj")

"""Small factories for tests: random HF checkpoints of each family (saved with save_pretrained as
safetensors, with a real BPE tokenizer and a ChatML template), and engines over them."""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, this is a small test corpus",
    "Paris is the capital of France.", "def add(a, b):\n    return a + b\n", "1234567890 + 42 = 1234567932",
    "prefill and decode workers stream key value blocks", "a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


def save_tokenizer(path: str, vocab_size: int = 256) -> None:
    """Train a byte-level BPE tokenizer on a tiny corpus and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML,
                   "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def hf_config(family: str, **overrides: Any) -> Any:
    """A small random config of ``family``: llama, llama3 (rope scaling, tied), qwen2, qwen3."""
    import transformers

    common: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                  max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=2)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
    elif family == "llama3":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_checkpoint(path: str, family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """Save a random model of ``family`` to ``path``; returns the transformers model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # make the random weights less degenerate than init's tiny values
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    save_tokenizer(path, vocab_size=cfg.vocab_size - 8)
    return model


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_logits(llm: Any, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits at every prompt position from ``llm``'s engine, computed chunk by chunk over the
    paged cache (the chunks after the first attend to the cached prefix)."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.request import Request
    from cluster.engine.scheduler import ScheduledRequest, SchedulerOutput

    eng = llm.engine
    req = Request("probe", ids, SamplingParams())
    assert eng.kv.allocate("probe", len(ids))
    pieces = []
    try:
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            sched = SchedulerOutput([ScheduledRequest(req, start, n, "probe", ids[start:start + n])],
                                    {"probe": eng.kv.block_tables("probe")})
            hidden, _ = eng.runner.forward(sched)
            pieces.append(eng.model.compute_logits(hidden))
    finally:
        eng.kv.free("probe")
    return torch.cat(pieces)


def mixed_prompts(vocab: int, lengths: tuple[int, ...] = (3, 9, 17, 33, 50, 64), seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def output_summary(outputs: Any) -> list[Any]:
    """What two generations must agree on, per sample: tokens, text, finish and stop reasons,
    logprobs (rounded to 4 places)."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [sorted((t, round(lp.logprob, 4)) for t, lp in p.items()) for p in (c.logprobs or [])])
             for c in o.outputs] for o in outputs]


def run_with_aborts(engine: Any, prompts: list[list[int]], requests: int = 200, seed: int = 5) -> None:
    """Add ``requests`` requests (greedy or sampled, 1-29 tokens), stepping 0-2 times between
    them and aborting a random live one 30% of the time, then step until nothing is left."""
    import itertools
    import random

    from cluster.common.sampling_params import SamplingParams
    rng = random.Random(seed)
    ids = itertools.count()
    live: list[str] = []
    for _ in range(requests):
        rid = f"a{next(ids)}"
        engine.add_request(rid, rng.choice(prompts), SamplingParams(temperature=rng.choice([0.0, 0.9]),
                                                                   max_tokens=rng.randrange(1, 30), seed=rng.randrange(9)))
        live.append(rid)
        for _ in range(rng.randrange(0, 3)):
            engine.step()
        if rng.random() < 0.3:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    while engine.has_work():
        engine.step()


@contextlib.contextmanager
def local_pd_workers(settings: dict[str, Any], wrap_prefill: Any = None) -> Iterator[tuple[Any, Any]]:
    """A prefill worker and a decode worker in this process, KV over ``local`` transfer, built
    from cluster ``settings``; ``wrap_prefill(prefill_fn)`` may stand between them (to edit what
    prefill hands over). Shut down on exit."""
    import uuid

    from cluster.config import parse_cluster_args
    from cluster.decode.worker import DecodeWorker
    from cluster.prefill.worker import PrefillWorker
    config = parse_cluster_args({"kv_transfer": "local", **settings}, use_env=False)
    prefill = PrefillWorker(config, engine_id=f"p-{uuid.uuid4().hex[:6]}")
    prefill_fn = prefill.prefill if wrap_prefill is None else wrap_prefill(prefill.prefill)
    decode = DecodeWorker(config, engine_id=f"d-{uuid.uuid4().hex[:6]}", prefill_fn=prefill_fn)
    try:
        yield prefill, decode
    finally:
        decode.shutdown()
        prefill.shutdown()


def generate_disaggregated(decode: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    """Each prompt's output tokens, generated concurrently through a decode worker (which calls
    its prefill worker); a request that ends in an error fails the test."""
    import asyncio

    from cluster.common.messages import GenerateRequest

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in decode.generate(GenerateRequest(f"r{i}", prompt, params)):
            assert not out.error, out.error
            tokens += out.new_token_ids
        return tokens

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return asyncio.run(run())

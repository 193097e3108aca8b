"""Tokenizer: a ``tokenizers.Tokenizer`` plus what HF's tokenizer_config.json adds (special tokens,
BOS handling, the chat template), with incremental detokenization for streaming."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from cluster.common.errors import InvalidRequestError, ModelLoadError


def _token_content(value: object) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    #: Prepend BOS when encoding a plain prompt (when the backend's post-processor does not already).
    add_bos_token: bool = False
    extra_eos_token_ids: tuple[int, ...] = ()
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_dir(cls, model_dir: str) -> Tokenizer:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{model_dir}: no tokenizer.json", param="model")
        backend = HFTokenizer.from_file(path)
        config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        extra_eos: list[int] = []
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            extra_eos = [eos] if isinstance(eos, int) else [e for e in (eos or []) if isinstance(e, int)]
        return cls.build(backend, bos_token=_token_content(config.get("bos_token")),
                         eos_token=_token_content(config.get("eos_token")), chat_template=template,
                         add_bos_token=bool(config.get("add_bos_token", False)), extra_eos_token_ids=extra_eos)

    @classmethod
    def build(cls, backend: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
              chat_template: str | None, add_bos_token: bool, extra_eos_token_ids: list[int]) -> Tokenizer:
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # A post-processor that already inserts BOS makes add_bos_token redundant.
        if add_bos_token and bos_token is not None:
            probe = backend.encode("a", add_special_tokens=True).ids
            if probe and probe[0] == backend.token_to_id(bos_token):
                add_bos_token = False
        return cls(backend, bos_token, eos_token, chat_template, add_bos_token,
                   tuple(extra_eos_token_ids), special)

    # --- ids ---------------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.extra_eos_token_ids)
        if self.eos_token is not None:
            eos = self.backend.token_to_id(self.eos_token)
            if eos is not None and eos not in ids:
                ids.insert(0, eos)
        return tuple(ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # --- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template; use completions",
                                      param="messages")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself (BOS included), as transformers assumes.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything, holding
    back bytes that do not yet form whole characters (the prefix/read offset method)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        # Start from a few prompt tokens so that leading-space handling matches a full decode.
        self.ids: list[int] = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.skip_special and token_id in self.tokenizer.special_token_ids:
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

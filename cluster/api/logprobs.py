"""Logprobs in OpenAI's two shapes, from the engine's per-position ``{token_id: Logprob}`` maps
(the sampled token first, then the top-N by rank).

Completions (``logprobs: int``): parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
(a dict of the top-N plus the sampled token, as OpenAI's legacy API returns up to N+1 entries) and
``text_offset`` (where each token's text starts in the generated text). Chat (``logprobs: true``,
``top_logprobs: N``): one entry per token with its text, logprob, UTF-8 bytes and the top-N list.
"""
from __future__ import annotations

import math
import re

from cluster.api.schemas import CompletionLogprobs, TokenLogprob, TopLogprob
from cluster.common.outputs import PositionLogprobs
from cluster.models.tokenizer import Tokenizer

#: What OpenAI reports for an impossible token (JSON has no -Infinity).
MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


class TokenTexts:
    """Each token's decoded text and raw bytes, cached (logprobs name every token they list)."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        #: Name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids), exact for any vocabulary.
        self._as_ids = as_ids
        self._byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            entry = self._cache[token_id] = self._lookup(token_id)
        return entry

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self._as_ids:
            name = f"token_id:{token_id}"
            return name, list(name.encode())
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self._tokenizer.id_to_token(token_id) or ""
        raw: list[int] | None = None
        if self._byte_level and piece and all(ch in _UNICODE_TO_BYTE for ch in piece):
            raw = [_UNICODE_TO_BYTE[ch] for ch in piece]
        elif (m := _BYTE_FALLBACK.match(piece)) is not None:
            raw = [int(m.group(1), 16)]
        if raw is None or token_id in self._tokenizer.special_token_ids:
            raw = list(text.encode("utf-8"))
        return text, raw


def _clamp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, float]]:
    """The top ``num_top`` entries of a position by rank (the engine's ranks start at 1)."""
    ranked = [(tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= num_top]
    ranked.sort(key=lambda e: e[1].rank or 0)
    return [(tid, _clamp(lp.logprob)) for tid, lp in ranked[:num_top]]


def completion_logprobs(texts: TokenTexts, token_ids: list[int],
                        positions: list[PositionLogprobs] | None, num_top: int,
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Logprobs of ``token_ids`` in the completions shape; returns them and the text offset after
    the last token (the next call's ``text_offset`` while streaming)."""
    out = CompletionLogprobs()
    for i, tid in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else None
        text = texts.text(tid)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if position is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        chosen = position.get(tid)
        out.token_logprobs.append(None if chosen is None else _clamp(chosen.logprob))
        top = {texts.text(t): lp for t, lp in _top(position, num_top)}
        if chosen is not None:
            top.setdefault(text, _clamp(chosen.logprob))
        out.top_logprobs.append(top)
    return out, text_offset


def chat_logprobs(texts: TokenTexts, token_ids: list[int],
                  positions: list[PositionLogprobs] | None, num_top: int) -> list[TokenLogprob]:
    """Logprobs of ``token_ids`` in the chat shape (``choices[].logprobs.content``)."""
    content = []
    for i, tid in enumerate(token_ids):
        position = positions[i] if positions is not None and i < len(positions) else {}
        text, raw = texts.get(tid)
        chosen = position.get(tid)
        top = []
        for t, lp in _top(position, num_top):
            t_text, t_raw = texts.get(t)
            top.append(TopLogprob(token=t_text, logprob=lp, bytes=t_raw))
        content.append(TokenLogprob(token=text, logprob=MIN_LOGPROB if chosen is None else _clamp(chosen.logprob),
                                    bytes=raw, top_logprobs=top))
    return content

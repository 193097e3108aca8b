"""Output processing: detokenizes each sample incrementally, applies the stop conditions that need
text or counts (EOS, stop token ids, stop strings, max_tokens, max_model_len), and assembles the
user-facing RequestOutput of a request's n samples.

Stop strings never appear in the output text; while a sample runs, the last ``len(stop) - 1``
characters are held back from ``visible_text`` so a stream never shows the start of a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.common.outputs import CompletionOutput, RequestOutput
from cluster.engine.request import Request, RequestStatus
from cluster.engine.spec_decode import SpecDecodeStats
from cluster.models.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SampleText:
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    #: Characters of ``text`` that may be shown (the rest might begin a stop string).
    visible: int = 0
    #: Characters, tokens and logprobs already emitted in a delta.
    sent_chars: int = 0
    sent_tokens: int = 0


@dataclass
class RequestGroup:
    """A user request: its prompt and its n samples (engine requests)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Request]
    texts: list[SampleText] = field(default_factory=list)
    #: Samples 1..n-1 while sample 0 computes the prompt: the step that draws its first token
    #: draws theirs too, and they fork its KV (LLMEngine._settle_held), so the prompt is computed once.
    held: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.samples)

    def delta(self) -> RequestOutput:
        """What is new since the last delta: per sample that has new tokens, new text or has just
        finished, its new token ids, text and logprobs and its finish state (a sample reported
        finished is not reported again). Costs what is new, not the whole output."""
        outs = []
        for i, (s, t) in enumerate(zip(self.samples, self.texts)):
            if t.sent_tokens < 0:  # finished and reported
                continue
            finished = s.status.finished
            end = len(t.text) if finished else t.visible
            tokens = s.output_token_ids[t.sent_tokens:]
            if not tokens and end <= t.sent_chars and not finished:
                continue
            logprobs = s.output_logprobs[t.sent_tokens:] if s.sampling_params.logprobs is not None else None
            outs.append(CompletionOutput(index=i, text=t.text[t.sent_chars:end], token_ids=tokens,
                                         finish_reason=s.status.finish_reason, logprobs=logprobs,
                                         stop_reason=s.stop_reason))
            t.sent_chars, t.sent_tokens = max(t.sent_chars, end), len(s.output_token_ids)
            if finished:
                t.sent_tokens = -1
        failed = [s for s in self.samples if s.error_kind is not None]
        first = self.samples[0]
        metrics = {}
        if first.first_token_time is not None:
            metrics["ttft_s"] = first.first_token_time - first.arrival_time
        metrics.update(SpecDecodeStats.request_metrics(self.samples))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             num_cached_tokens=max(0, first.num_cached_tokens), finished=self.finished,
                             error=failed[0].error if failed else None,
                             error_kind=failed[0].error_kind if failed else None, metrics=metrics)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def make_text(self, request: Request) -> SampleText:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                           request.sampling_params.skip_special_tokens)
        return SampleText(detok)

    def on_token(self, request: Request, text: SampleText) -> RequestStatus | None:
        """Account for the token just appended to ``request``; returns the finish status if the
        sample must stop now."""
        p = request.sampling_params
        token = request.output_token_ids[-1]
        searched = len(text.text)
        if text.detokenizer is not None:
            text.text += text.detokenizer.add(token)
        status: RequestStatus | None = None
        if request.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in request.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                request.stop_reason = token
                status = RequestStatus.FINISHED_STOPPED
            elif p.stop and self._truncate_at_stop(request, text, searched):
                status = RequestStatus.FINISHED_STOPPED
        if status is None and p.max_tokens is not None and request.num_output_tokens >= p.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is None and request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        hold = max((len(s) for s in p.stop), default=1) - 1 if status is None else 0
        text.visible = max(text.visible, len(text.text) - hold)
        return status

    @staticmethod
    def _truncate_at_stop(request: Request, text: SampleText, searched: int) -> bool:
        """Cut the text at the earliest stop string; only the new text (and the stop's length
        before it) needs searching."""
        best: tuple[int, str] | None = None
        for stop in request.sampling_params.stop:
            at = text.text.find(stop, max(0, searched - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        text.text = text.text[: best[0]]
        request.stop_reason = best[1]
        return True

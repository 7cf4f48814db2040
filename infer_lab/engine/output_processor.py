"""From accepted tokens to what a caller sees: text, stop strings, and the step's outputs.

The scheduler has appended each sequence's new tokens and stopped it at a stop token or at
``max_tokens``. What is left is about text, and it lives here (vLLM v1 keeps it in its
detokenizer and output processor, outside the engine core):

- **Detokenizing** each new token incrementally, and looking for a **stop string** in the text
  it added (:class:`~infer_lab.engine.stop.StopMatcher`). A stop string can end a sequence in the
  middle of a run of accepted proposals: :meth:`OutputProcessor.detokenize` says where, and the
  scheduler cuts the tokens after it.
- **Building** each request's :class:`~infer_lab.engine.outputs.RequestOutput`: everything so
  far plus this step's delta, holding back the last ``len(longest stop string) - 1``
  characters of a running sequence (a stop string may still complete across them, and text
  handed out cannot be taken back).
- **Failing** a request alone when something of its own breaks, with a typed
  :class:`~infer_lab.engine.outputs.RequestFailure`: only what was already handed out goes back.
"""

from __future__ import annotations

from infer_lab.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from infer_lab.engine.scheduler import Scheduler
from infer_lab.engine.sequence import Request, Sequence
from infer_lab.engine.step_sampler import Run, SampledTokens


class OutputProcessor:
    """Text and outputs for the engine's requests (writes a sequence's text fields only)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler  # to fail a request whose output cannot be built
        self.num_failed_requests = 0

    # ------------------------------------------------------------------ text
    def detokenize(self, sampled: SampledTokens, now: float) -> dict[Sequence, tuple[int, str]]:
        """Add each sequence's new tokens to its text; ``{seq: (n, stop)}`` for the sequences a
        stop string ends after their ``n``-th output token."""
        stops: dict[Sequence, tuple[int, str]] = {}
        for seq, run in zip(sampled.seqs, sampled.runs):
            if seq.request in sampled.failed:
                continue
            try:
                stop = self._add_tokens(seq, run, now)
            except Exception as e:
                sampled.fail(seq.request, "its new token", e)
                continue
            if stop is not None:
                stops[seq] = stop
        return stops

    def _add_tokens(self, seq: Sequence, run: Run, now: float) -> tuple[int, str] | None:
        """Record and detokenize the tokens the scheduler kept, stopping at a stop string."""
        done = len(seq.token_times)
        new = seq.token_ids[seq.num_prompt_tokens + done :]  # one copy of the new tokens only
        stop_ids = seq.request.stop_ids
        for j, token in enumerate(new):
            seq.token_times.append(now)
            logprobs = run[j][1]
            if logprobs is not None:
                if seq.logprobs is None:
                    seq.logprobs = []
                seq.logprobs.append(logprobs)
            searched = len(seq.text)
            if seq.detokenizer is not None:
                seq.text += seq.detokenizer.add(token)
            if token in stop_ids or done + j < seq.request.params.min_tokens:
                searched = len(seq.text)  # a stop token's text, or before min_tokens (vLLM)
            elif (hit := self._stop_string(seq, searched)) is not None:
                return done + j + 1, hit
            if j == len(new) - 1 and seq.is_finished and seq.detokenizer is not None:
                searched = len(seq.text)
                seq.text += seq.detokenizer.flush()  # the last characters held for a merge
                if (hit := self._stop_string(seq, searched)) is not None:
                    return done + j + 1, hit
        return None

    @staticmethod
    def _stop_string(seq: Sequence, searched: int) -> str | None:
        """A stop string ending in the text added since ``searched``: trim the text there."""
        matcher = seq.request.stop_matcher
        if matcher is None:
            return None
        hit = matcher.find(seq.text, searched)
        if hit is None:
            return None
        at, stop = hit
        seq.text = seq.text[:at]
        return stop

    # ------------------------------------------------------------------ outputs
    def make_outputs(self, sampled: SampledTokens, now: float) -> list[RequestOutput]:
        """One output per request that moved this step (its failure, if it failed)."""
        outputs = []
        for request in dict.fromkeys(s.request for s in sampled.seqs):
            failure = sampled.failed.get(request)
            if failure is None:
                try:
                    outputs.append(self._output(request))
                    continue
                except Exception as e:
                    sampled.fail(request, "its output", e)
                    failure = sampled.failed[request]
                    self.scheduler.abort(request.seqs, "error", now, every=True)
            self.num_failed_requests += 1
            completions = [self._failed_completion(seq) for seq in request.seqs]
            outputs.append(RequestOutput(request.request_id, request.prompt,
                                         request.prompt_token_ids, completions, True,
                                         request_metrics(request), failure))
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            hold = 0 if seq.is_finished else max(0, request.params.max_stop_len - 1)
            safe = max(seq.emitted_text_len, len(seq.text) - hold)
            delta_text = seq.text[seq.emitted_text_len : safe]
            seq.emitted_text_len = safe
            first = seq.emitted_tokens
            seq.emitted_tokens = seq.num_output_tokens
            completions.append(completion(seq, seq.text[:safe], seq.emitted_tokens,
                                          seq.finish_reason, seq.stop_reason, delta_text, first))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, request.is_finished, request_metrics(request),
                             prompt_logprobs=request.prompt_logprobs)

    @staticmethod
    def _failed_completion(seq: Sequence) -> CompletionOutput:
        """Only what was already handed out: the rest never reached the caller."""
        return completion(seq, seq.text[: seq.emitted_text_len], seq.emitted_tokens, "error",
                          None, "", seq.emitted_tokens)


def completion(seq: Sequence, text: str, num_tokens: int, finish_reason: str | None,
               stop_reason: str | int | None, delta_text: str,
               delta_from: int) -> CompletionOutput:
    """``seq``'s first ``num_tokens`` output tokens as a :class:`CompletionOutput`, with the
    tokens from ``delta_from`` on as this step's delta."""
    start = seq.num_prompt_tokens
    ids = seq.token_ids[start : start + num_tokens]
    lps = None if seq.logprobs is None else seq.logprobs[:num_tokens]
    return CompletionOutput(
        index=seq.index, text=text, token_ids=ids, finish_reason=finish_reason,
        stop_reason=stop_reason, delta_text=delta_text, delta_token_ids=ids[delta_from:],
        token_times=seq.token_times[:num_tokens], num_preemptions=seq.num_preemptions,
        logprobs=lps, delta_logprobs=[] if lps is None else lps[delta_from:],
    )


def request_metrics(request: Request) -> RequestMetrics:
    """A request's timestamps and its samples' speculative-decoding counts, summed."""
    drafts = draft_tokens = accepted = 0
    for seq in request.seqs:
        c = seq.spec_counts
        drafts, draft_tokens = drafts + c.num_drafts, draft_tokens + c.num_draft_tokens
        accepted += c.num_accepted_tokens
    return RequestMetrics(request.arrival_time, request.first_scheduled_time,
                          request.first_token_time, request.finish_time, drafts, draft_tokens,
                          accepted)

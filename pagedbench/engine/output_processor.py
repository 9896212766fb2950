"""OutputProcessor: what a step's new tokens mean for their requests. It detokenizes them
incrementally and records logprobs and prompt logprobs (for Scheduler.update_from_output, which
appends the tokens and checks stops), and builds each request's RequestOutput of the kind it asked
for (SamplingParams.output_kind, vLLM's): everything so far (CUMULATIVE), what is new since its last
output (DELTA: O(new tokens) a step), or nothing until it finishes (FINAL_ONLY: O(1) a step)."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedbench.device.transfer import to_device, to_list
from pagedbench.engine.detokenizer import IncrementalDetokenizer, backend_tokenizer
from pagedbench.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedbench.engine.request import SequenceGroup
from pagedbench.engine.sequence import Sequence
from pagedbench.sample.sampler import SamplerOutput
from pagedbench.sample.sampling_params import RequestOutputKind


@dataclass(slots=True)
class Sent:
    """What a DELTA request's sample has been given so far: output tokens (and their logprobs) and text."""

    tokens: int = 0
    text: int = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        if tokenizer is not None:
            backend_tokenizer(tokenizer)  # a tokenizer DecodeStream cannot use fails here, not mid-step
        self.tokenizer = tokenizer
        self.sent: dict[str, dict[int, Sent]] = {}  # DELTA requests: per sample index, what went out

    def new_text(self, seq: Sequence, token: int) -> str:
        """The text `seq`'s new output `token` adds to its output_text ("" where it is not decoded)."""
        detokenizer = self._detokenizer(seq)
        new_text = detokenizer.step(token) if detokenizer is not None else ""
        seq.output_text += new_text
        return new_text

    def flush_text(self, seq: Sequence) -> None:
        """`seq` has stopped: the text held back for a partial character, unless a stop string ended it."""
        if seq.detokenizer is not None and not isinstance(seq.stop_reason, str):
            seq.output_text += seq.detokenizer.flush()

    def record_logprobs(self, seqs: list[Sequence], rows: list[int], out: SamplerOutput) -> None:
        """For the batch rows `rows` (of `seqs`): cumulative logprobs, and where the request asks
        for logprobs, the sampled token's and the top ones (vLLM's layout: token id -> Logprob)."""
        tokens, picked, ranks = out.tokens, out.token_logprobs, out.token_ranks  # host lists (to_host)
        top = (out.top_token_ids, out.top_logprobs) if out.top_token_ids is not None else None
        for k, row in enumerate(rows):
            seq = seqs[row]
            seq.cumulative_logprob += picked[k]
            if seq.params.logprobs is None:
                continue
            entry = {}
            if top is not None:
                for rank, (tid, lp) in enumerate(zip(top[0][k][: seq.params.logprobs], top[1][k]), 1):
                    entry[tid] = Logprob(lp, rank, self._token_text(tid, seq))
            entry[tokens[row]] = Logprob(picked[k], ranks[k], self._token_text(tokens[row], seq))
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(entry)

    def record_prompt_logprobs(self, seqs: list[Sequence], rows: list[tuple[int, int, int]], logits) -> None:
        """Prompt logprobs of this step's prompt chunks: logits row j of (seq, first, count)
        predicts prompt token first + j + 1."""
        offset = 0
        for i, first, count in rows:
            seq = seqs[i]
            chunk = logits[offset : offset + count].log_softmax(dim=-1)
            offset += count
            targets = seq.prompt_token_ids[first + 1 : first + 1 + count]
            picked = chunk.gather(-1, to_device(np.array(targets, dtype=np.int64), chunk.device)[:, None])
            ranks = to_list((chunk > picked).sum(dim=-1) + 1)
            top_lps, top_ids = (
                map(to_list, chunk.topk(seq.params.prompt_logprobs, dim=-1))
                if seq.params.prompt_logprobs
                else (None, None)
            )
            picked = to_list(picked.squeeze(-1))
            seq.prompt_logprobs = seq.prompt_logprobs or []
            for j, token in enumerate(targets):
                entry = {}
                if top_ids is not None:
                    for rank, (tid, lp) in enumerate(zip(top_ids[j], top_lps[j]), 1):
                        entry[tid] = Logprob(lp, rank, self._token_text(tid, seq))
                entry[token] = Logprob(picked[j], ranks[j], self._token_text(token, seq))
                seq.prompt_logprobs.append(entry)

    def output(self, group: SequenceGroup) -> RequestOutput:
        return request_output(group, self._decode)

    def process_outputs(self, progressed: list, now: float) -> list[RequestOutput]:
        """The outputs of the requests a step progressed (RequestProgress, from update_from_output),
        whose new tokens arrived `now` (tokens verified together arrive together), each of its
        output_kind: a FINAL_ONLY request's only once it has finished."""
        outputs = []
        for p in progressed:
            group = p.group
            if p.num_new_tokens == 1:
                group.token_times.append(now)
            else:
                group.token_times += [now] * p.num_new_tokens
            kind = getattr(group.params, "output_kind", RequestOutputKind.CUMULATIVE)  # beam search: cumulative
            if kind is RequestOutputKind.DELTA:
                outputs.append(self.delta_output(group))
            elif kind is RequestOutputKind.CUMULATIVE or group.finished:
                outputs.append(self.output(group))
        return outputs

    def delta_output(self, group: SequenceGroup) -> RequestOutput:
        """What is new in the request since its last output (its prompt logprobs in the first)."""
        first = group.request_id not in self.sent
        sent = self.sent.setdefault(group.request_id, {})
        stop = group.params.stop
        holdback = max(map(len, stop)) - 1 if stop else 0
        samples = [delta_completion(s, sent.setdefault(s.index, Sent()), holdback) for s in group.seqs]
        if group.finished:
            del self.sent[group.request_id]
        return request_output(group, samples=sorted(samples, key=lambda c: c.index), with_prompt_logprobs=first)

    def forget(self, request_ids: list[str]) -> None:
        """Requests that left unfinished (aborted): nothing more goes out for them."""
        for request_id in request_ids:
            self.sent.pop(request_id, None)

    def _decodes(self, seq: Sequence) -> bool:
        """Whether `seq`'s tokens become text: there is a tokenizer and the request did not ask for token ids only."""
        return self.tokenizer is not None and getattr(seq.params, "detokenize", True)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer | None:
        """`seq`'s incremental detokenizer (made at its first output token), or None where it is not decoded."""
        if seq.detokenizer is None and self._decodes(seq):
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
            )
        return seq.detokenizer

    def _token_text(self, token: int, seq: Sequence) -> str | None:
        return self.tokenizer.decode([token]) if self._decodes(seq) else None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def completions(group: SequenceGroup, decode: Callable[[list[int]], str] | None) -> list[CompletionOutput]:
    """The request's returned samples: its n samples by index, or once finished with best_of > n
    the n best by cumulative logprob; a beam search's finished beams, best first."""
    if group.beam is not None:
        return [
            CompletionOutput(
                i,
                decode(h.output_token_ids) if decode else "",
                h.output_token_ids,
                h.finish_reason,
                h.stop_reason,
                h.cum_logprob,
            )
            for i, h in enumerate(group.beam.finished if group.finished else [])
        ]
    p = group.params
    seqs = sorted(group.seqs, key=lambda s: s.index)
    if group.finished and p.best_of > p.n:
        seqs.sort(key=lambda s: -s.cumulative_logprob)
    return [
        CompletionOutput(
            s.index,
            s.output_text,
            s.output_token_ids,
            s.finish_reason,
            s.stop_reason,
            reported_cumulative_logprob(s),
            None if s.logprobs is None else list(s.logprobs),
        )
        for s in seqs[: p.n]
    ]


def delta_completion(seq: Sequence, sent: Sent, holdback: int) -> CompletionOutput:
    """`seq`'s tokens, logprobs and text since `sent` (then marked sent). Until it finishes, the last
    `holdback` characters wait: they could start a stop string, which cuts them (vLLM's rule)."""
    text_end = len(seq.output_text) if seq.finished else max(sent.text, len(seq.output_text) - holdback)
    delta = CompletionOutput(
        seq.index,
        seq.output_text[sent.text : text_end],
        seq.token_ids[seq.num_prompt_tokens + sent.tokens :],
        seq.finish_reason,
        seq.stop_reason,
        reported_cumulative_logprob(seq),
        None if seq.logprobs is None else seq.logprobs[sent.tokens :],
    )
    sent.tokens, sent.text = seq.num_output_tokens, text_end
    return delta


def reported_cumulative_logprob(seq: Sequence) -> float | None:
    """A sample's cumulative logprob where its request can read it (best_of, logprobs), else None."""
    p = seq.params
    return seq.cumulative_logprob if p.best_of > 1 or p.logprobs is not None else None


def request_output(
    group: SequenceGroup,
    decode: Callable[[list[int]], str] | None = None,
    samples: list[CompletionOutput] | None = None,
    with_prompt_logprobs: bool = True,
) -> RequestOutput:
    """The request's output so far (`samples`: its completions, else all of each so far); metrics
    once it has finished."""
    metrics = None
    finished = group.finished
    if finished:
        times = group.token_times
        metrics = RequestMetrics(group.arrival_time, times[0], times, times[-1], group.num_preemptions)
    first = group.seqs[0] if group.seqs and group.beam is None else None
    wanted = with_prompt_logprobs and first is not None and first.params.prompt_logprobs is not None
    prompt_logprobs = (first.prompt_logprobs or []) if wanted else None
    group.note_cached_tokens()
    return RequestOutput(
        group.request_id,
        group.prompt,
        group.prompt_token_ids,
        completions(group, decode) if samples is None else samples,
        finished,
        metrics,
        None if prompt_logprobs is None else [None, *prompt_logprobs],  # nothing predicts the first token
        group.num_cached_tokens,
    )

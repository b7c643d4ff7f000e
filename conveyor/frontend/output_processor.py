"""From the core's per-sequence deltas to what callers receive, keyed by request id (front end).

Owns everything about a request's output that is not scheduling: the ``n`` sibling
sequences of one request, incremental detokenization, stop strings (scanned incrementally,
see stop_strings.py), the text held back while it may still become a stop string, and the
deltas already sent. It never finishes a request itself: a stop string it finds comes back
as a finish command that the engine hands to the core (the scheduler's ``finish_request``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache

from conveyor.core.engine_core import SeqUpdate
from conveyor.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from conveyor.frontend.stop_strings import StopScanner
from conveyor.core.wire import Finish
from conveyor.request import RequestMetrics, RequestStatus
from conveyor.sampling.params import SamplingParams
from conveyor.scheduler.output import LogprobEntry
from conveyor.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Seq:
    seq_id: str
    index: int
    detok: IncrementalDetokenizer
    stops: StopScanner | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    text: str = ""                 # text so far, cut at a stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    cum_logprob: float = 0.0       # the sum of the sampled tokens' logprobs (params.needs_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def cumulative_logprob(self) -> float:
        return self.cum_logprob

    def add_token(self, u: SeqUpdate, token_id: int, entry: dict | None, timed: bool = True) -> None:
        """A new token, its logprobs entry (None: not asked), its time (this sequence's own metrics;
        timed=False: a later token of the same update, whose step's latency is already recorded)."""
        self.token_ids.append(token_id)
        if entry is not None:
            self.logprobs.append(entry)
            self.cum_logprob += entry.get(token_id, 0.0)
        m = self.metrics
        if u.metrics is None and u.token_time is not None:   # metrics come whole with the first token only
            if m.last_token_time is not None and timed:
                m.inter_token_latencies.append(u.token_time - m.last_token_time)
            m.last_token_time = u.token_time

    def end(self, reason: str, stop_reason: int | str | None, now: float | None) -> None:
        """Finished here (a stop string, an abort, a failure) or by the core (with its metrics)."""
        self.finish_reason, self.stop_reason = reason, stop_reason
        if self.metrics.finished_time is None and now is not None:
            self.metrics.finished_time = now

    def visible_len(self) -> int:
        """Text that can be shown now: all once finished, else without a tail that may become a stop string."""
        held = 0 if self.finished or self.stops is None else self.stops.held
        return max(len(self.text) - held, self.sent_text)


@dataclass(slots=True)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | None
    seqs: list[_Seq]
    error: str | None = None
    error_code: str | None = None
    prompt_logprobs: list | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._token_text = lru_cache(maxsize=1 << 16)(tokenizer.id_to_token_str)   # Logprob.decoded_token
        self._groups: dict[str, _Group] = {}
        self._seqs: dict[str, tuple[_Group, _Seq]] = {}
        self._to_report: dict[str, _Group] = {}   # changed outside a step (abort)

    # ---- requests ------------------------------------------------------------------------
    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            seq_ids: list[str], arrival_time: float) -> None:
        """Register a request and its sibling sequences before they run."""
        assert request_id not in self._groups
        group = _Group(request_id, prompt, prompt_token_ids, params, [])
        for i, seq_id in enumerate(seq_ids):
            seq = _Seq(seq_id, i, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                       StopScanner(params.stop) if params.stop else None, RequestMetrics(arrival_time))
            group.seqs.append(seq)
            self._seqs[seq_id] = (group, seq)
        self._groups[request_id] = group

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def live_seq_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return [] if group is None else [s.seq_id for s in group.seqs if not s.finished]

    def abort(self, request_id: str, report: bool = True) -> list[str]:
        """Mark a request aborted; returns the ids of its sequences the core must abort."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        live = [s.seq_id for s in group.seqs if not s.finished]
        for s in group.seqs:
            if not s.finished:
                s.end("abort", None, time.monotonic())
        if report:
            self._to_report[request_id] = group
        else:
            self._forget(group)
        return live

    # ---- a step's updates ------------------------------------------------------------------
    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[Finish]]:
        """Outputs of every request that changed, and the finishes the core must apply."""
        changed, commands = self._to_report, []
        self._to_report = {}
        for u in updates:
            found = self._seqs.get(u.seq_id)
            if found is None:
                continue
            group, seq = found
            changed[group.request_id] = group
            try:
                self._apply(group, seq, u, commands)
            except Exception as e:   # noqa: BLE001 - one request's output must not break the others
                logger.exception("output processing failed for request %s", group.request_id)
                self._fail(group, f"output processing failed: {type(e).__name__}: {e}", commands)
        outputs = []
        for group in changed.values():
            outputs.append(self._output(group))
            if group.finished:
                self._forget(group)
        return outputs, commands

    def _apply(self, group: _Group, seq: _Seq, u: SeqUpdate, commands: list[Finish]) -> None:
        if u.metrics is not None:   # sent with the first token and the finish (a copy: ours to update)
            seq.metrics = u.metrics
        if u.prompt_logprobs is not None and group.prompt_logprobs is None:
            group.prompt_logprobs = [logprob_objects(e, self._token_text) for e in u.prompt_logprobs]
        if u.embedding is not None:
            group.embedding = u.embedding
        if u.error is not None:
            self._fail(group, u.error, commands, u.error_code)
            return
        if u.prev_token_ids:   # speculative tokens accepted before u.token_id: each as if it came alone
            lps = u.prev_logprobs or [None] * len(u.prev_token_ids)
            for i, (token, lp) in enumerate(zip(u.prev_token_ids, lps)):
                if seq.finished:
                    return
                self._token(group, seq, u, token, lp, None, commands, timed=i == 0)
        if seq.finished:   # e.g. a stop string already ended it: a late token is not shown
            return
        self._token(group, seq, u, u.token_id, u.logprobs, u.finish_reason, commands, timed=not u.prev_token_ids)

    def _token(self, group: _Group, seq: _Seq, u: SeqUpdate, token_id: int | None, logprobs: LogprobEntry | None,
               finish_reason: str | None, commands: list[Finish], timed: bool = True) -> None:
        new = ""
        if token_id is not None:
            entry = logprob_objects(logprobs, self._token_text) if group.params.needs_logprobs else None
            seq.add_token(u, token_id, entry, timed)
            if group.params.needs_logprobs and entry is None:
                seq.logprobs.append(None)
            new = seq.detok.add([token_id]) if group.params.detokenize else ""
        if finish_reason is not None:
            new += seq.detok.flush()
        hit = seq.stops.feed(new) if seq.stops is not None and new else None
        if hit is not None:
            end, stop = hit
            cut = end if group.params.include_stop_str_in_output else end - len(stop)
            seq.text += new[:max(cut, 0)]
            if cut < 0:   # the stop string began in text already appended (held back, not yet sent)
                seq.text = seq.text[:len(seq.text) + cut]
            if u.finish_reason is None:
                commands.append(Finish(seq_ids=[seq.seq_id], status=RequestStatus.FINISHED_STOPPED, reason=stop))
            # finished by eos/length with the same token: the stop string wins
            seq.end("stop", stop, u.token_time)
            return
        seq.text += new
        if finish_reason is not None:
            seq.end(finish_reason, u.stop_reason, time.monotonic())

    def _fail(self, group: _Group, message: str, commands: list[Finish], code: str | None = None) -> None:
        """The whole request fails with `message`; its live siblings are aborted."""
        if group.error is None:   # the first failure is the one reported
            group.error, group.error_code = message, code
        live = [s for s in group.seqs if not s.finished]
        if live:
            commands.append(Finish(seq_ids=[s.seq_id for s in live]))
        for s in live:
            s.end("error", None, time.monotonic())

    def _forget(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        self._to_report.pop(group.request_id, None)
        for s in group.seqs:
            self._seqs.pop(s.seq_id, None)

    # ---- outputs ---------------------------------------------------------------------------
    def _output(self, group: _Group) -> RequestOutput:
        if group.error is not None:
            return error_output(group.request_id, group.error, group.prompt, group.prompt_token_ids,
                                group.error_code)
        completions = []
        seqs = group.seqs
        p = group.params
        done = group.finished
        if p.num_seqs > p.n and done:   # best_of: the n with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob())[:p.n]
        # Every list handed out is a copy: the deltas (O(new tokens) per step) always, the whole
        # sequence's once, when it finishes. Nothing the stream reads is appended to later.
        for index, s in enumerate(seqs):
            shown = s.visible_len()
            lps = new_lps = cumulative = None   # best_of without logprobs: computed only to rank the samples
            if p.logprobs is not None:
                new_lps, cumulative = tuple(s.logprobs[s.sent_tokens:]), s.cumulative_logprob()
                lps = list(s.logprobs) if done else None
            completions.append(CompletionOutput(
                index if p.num_seqs > p.n else s.index, s.text[:shown], list(s.token_ids) if done else None, lps,
                s.finish_reason, s.stop_reason, s.text[s.sent_text:shown], tuple(s.token_ids[s.sent_tokens:]),
                cumulative, new_lps))
            s.sent_text, s.sent_tokens = shown, len(s.token_ids)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, group.finished,
                             [s.metrics for s in group.seqs], prompt_logprobs=group.prompt_logprobs,
                             embedding=group.embedding,
                             num_cached_tokens=max(s.metrics.num_cached_tokens for s in group.seqs))


def logprob_objects(entry: LogprobEntry | None, text_of) -> dict[int, Logprob] | None:
    """{token: Logprob}: floats that also read as vLLM's Logprob (.logprob, .rank, .decoded_token).
    The top-k tokens are ranked by their order; the target (sampled or prompt) token has its exact
    rank from the runner, also when it lies outside the top-k."""
    if entry is None:
        return None
    ranked = sorted(entry.logprobs.items(), key=lambda kv: -kv[1])
    return {t: Logprob(v, entry.rank if t == entry.token_id else r + 1, text_of(t)) for r, (t, v) in enumerate(ranked)}


def error_output(request_id: str, message: str, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None, code: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, prompt, prompt_token_ids or [],
                         [CompletionOutput(0, "", [], None, "error", message)], True, error=message,
                         error_code=code)

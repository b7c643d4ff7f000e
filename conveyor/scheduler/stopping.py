"""When a request finishes inside the engine core, and why: the one place that decides.

After each step ``Scheduler.update`` asks ``finish_verdict`` about every request it advanced:
an embedding whose prompt is computed, an end-of-sequence token (after ``min_tokens``), a stop
token id, the output-length limit, a grammar that can take nothing more. The verdict goes to
``Scheduler.finish_request``, the one way out of the scheduler. Finishes decided outside a step
arrive there too: a stop string found in the text by the front end (it has the text; the core
does not), a caller's abort, an error, a queue deadline. No torch here.
"""

from __future__ import annotations

from conveyor.request import Request, RequestStatus

Verdict = tuple[RequestStatus, int | str | None]   # (how it finished, the stop token id if one)


def finish_verdict(req: Request, token: int | None) -> Verdict | None:
    """How `req` finishes after this step (None: it goes on); `token`: what it sampled, if it did."""
    p = req.params
    if p.pooling is not None:   # an embedding: nothing to generate once the prompt is in
        return (RequestStatus.FINISHED_STOPPED, None) if req.num_computed_tokens >= req.num_prompt_tokens else None
    if token is None:
        return None
    n_out = req.num_output_tokens
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in p.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if n_out >= req.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if req.grammar_ended and (req.grammar_end is None or n_out >= req.grammar_end):
        # structured outputs: its grammar is complete or refused the token (speculative decoding: the
        # step's tokens are fed to the grammar before they are appended; it ended at grammar_end)
        return RequestStatus.FINISHED_STOPPED, None
    return None

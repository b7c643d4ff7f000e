"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the core's side: the one owner.

A request that asks for them carries one entry per prompt token computed so far (the first is
None: nothing predicts it; with ``prompt_logprobs_last`` every token before the last ones is None,
and those positions may come from the prefix cache: ``Request.cacheable_prefix``). Each prefill
chunk asks the runner for the logprobs of the prompt tokens that follow its rows
(``chunk_targets``); the step's entries are appended in ``collect``; the whole list goes to the
front end once, with the first sampled token
(``first_output``). A recompute preemption drops a partial list (``reset``), since its chunks
run again. The runner computes the entries (runner/model_runner.py), the front end turns them
into ``Logprob`` objects (frontend/output_processor.py). No torch here.
"""

from __future__ import annotations

from conveyor.request import Request, first_prompt_logprobs


def chunk_targets(req: Request, start: int, n: int) -> tuple[int, list[int]] | None:
    """(row, targets): the prompt tokens whose logprobs the chunk [start, start + n) yields, from its
    row `row` on (None: none wanted). The list holds an entry per token up to the next one wanted, so
    the row predicting it is len - 1; rows before it (``prompt_logprobs_last``) yield none."""
    if req.prompt_logprobs is None:
        return None
    first, last = len(req.prompt_logprobs) - 1, req.num_prompt_tokens - 1
    if not start <= first < start + n or first >= last:
        return None
    return first - start, req.prompt_token_ids[first + 1:min(start + n, last) + 1]


def collect(entries_by_id: dict | None, requests: dict[str, Request]) -> None:
    """Append a step's entries (request id -> this chunk's entries) to their live requests."""
    for rid, entries in (entries_by_id or {}).items():
        request = requests.get(rid)
        if request is not None and request.prompt_logprobs is not None:
            request.prompt_logprobs.extend(entries)


def first_output(req: Request) -> list | None:
    """What goes to the front end with this output: the whole list with the first token, else nothing."""
    return req.prompt_logprobs if req.num_output_tokens == 1 else None


def reset(req: Request) -> None:
    """Recomputed from scratch: a partial list would be appended to twice."""
    if req.prompt_logprobs_pending:
        req.prompt_logprobs = first_prompt_logprobs(req)

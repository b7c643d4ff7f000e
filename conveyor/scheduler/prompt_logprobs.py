"""Prompt logprobs (``SamplingParams.prompt_logprobs``) on the core's side: the one owner.

A request that asks for them carries one entry per prompt token computed so far (the first is
None: nothing predicts it). Each prefill chunk asks the runner for the logprobs of the prompt
tokens that follow its rows (``chunk_targets``); the step's entries are appended in
``collect``; the whole list goes to the front end once, with the first sampled token
(``first_output``). A recompute preemption drops a partial list (``reset``), since its chunks
run again. The runner computes the entries (runner/model_runner.py), the front end turns them
into ``Logprob`` objects (frontend/output_processor.py). No torch here.
"""

from __future__ import annotations

from conveyor.request import Request


def chunk_targets(req: Request, start: int, n: int) -> list[int] | None:
    """The prompt tokens whose logprobs the chunk [start, start + n) yields (None: none wanted)."""
    last = req.num_prompt_tokens - 1
    if req.prompt_logprobs is None or len(req.prompt_logprobs) != start + 1 or start >= last:
        return None
    return req.prompt_token_ids[start + 1:min(start + n, last) + 1]


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
    if req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
        req.prompt_logprobs = [None]

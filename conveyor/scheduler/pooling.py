"""Embedding requests (``SamplingParams.pooling``) on the core's side: the one owner.

An embedding request runs its prompt and nothing else. Its chunks tell the runner which rows to
pool (``chunk_pooling``: every row for "mean", the prompt's last row for "last") and whether the
chunk ends the prompt; the runner keeps the running sum in its per-request state (the tensor
math stays there) and returns the normalised embedding with the last chunk; ``collect`` hands it
to the step's outputs, and the request finishes then (scheduler/stopping.py). A recompute starts
over: the runner forgets a preempted request's state. No torch here.
"""

from __future__ import annotations

from conveyor.request import Request


def chunk_pooling(req: Request, start: int, n: int) -> tuple[str | None, bool]:
    """(the rows this chunk pools: "mean", "last" or None, whether it ends the prompt)."""
    mode = req.params.pooling
    if mode is None:
        return None, False
    end = start + n >= req.num_prompt_tokens
    if mode == "last" and not end:
        return None, False
    return mode, end


def collect(embeddings: dict[str, list[float]] | None, requests: dict[str, Request]) -> dict:
    """The embeddings a step finished, for requests still live: request id -> (request, vector)."""
    return {rid: (requests[rid], e) for rid, e in (embeddings or {}).items() if rid in requests}

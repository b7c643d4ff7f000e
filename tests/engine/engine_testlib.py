"""Shared helpers for the engine tests."""

from __future__ import annotations

from conveyor.engine.engine import Engine


def run_all(engine: Engine, prompts: list[list[int]], params, priorities=None, check=None) -> dict:
    """Drive the engine to completion; returns request id -> RequestOutput."""
    ids = [engine.add_request(p, params[i] if isinstance(params, list) else params,
                              priority=priorities[i] if priorities else 0) for i, p in enumerate(prompts)]
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check is not None:
            check(engine)
        steps += 1
        assert steps < 100_000, "engine did not finish"
    return [done[i] for i in ids]

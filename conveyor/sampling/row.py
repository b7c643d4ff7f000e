"""One sampling row: what the sampler needs of a sequence that samples a token this step.

It lives here, below the scheduler and the runner: the runner keeps one per request
(runner/state.py, built from the plan's ``NewRequestData`` and updated from its deltas;
scheduler/output.py re-exports it), the sampler reads it. Plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.sampling.params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence that samples a token this step."""

    params: SamplingParams
    seed: int                                  # effective seed: params.seed, or one the engine drew
    num_output_tokens: int                     # generated so far, before this step
    # Token history, present only when a penalty needs it (prompt: repetition penalty only).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None

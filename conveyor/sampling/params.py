"""Per-request sampling parameters, named and validated like vLLM's ``SamplingParams``."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import IntEnum

from conveyor.errors import InvalidRequestError
from conveyor.sampling.structured import StructuredOutputsParams

_MAX_LOGPROBS = 20
# Stop strings are matched by an automaton built per distinct set (O(total characters), about
# 1 ms per 1,000 characters); these bounds keep that and its memory small.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# Dividing or multiplying logits by the penalty must stay finite in fp32 (1e-39 is subnormal).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Below this temperature a request is greedy (same threshold as vLLM).
SAMPLING_EPS = 1e-5


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and not math.isnan(x)


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1


@dataclass(slots=True)
class SamplingParams:
    """How to sample the continuation of one prompt.

    Field names and defaults follow vLLM so that user code can switch engines unchanged.
    ``top_k`` of 0 or -1 disables top-k; ``temperature`` of 0 means greedy.
    """

    n: int = 1
    best_of: int | None = None   # sample this many, return the n with the highest cumulative logprob
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (the first has none) with this many top alternatives each.
    prompt_logprobs: int | None = None
    # ... of only the prompt's last this many tokens (None: all; the earlier entries are None). Only
    # the positions before those may come from the prefix cache: each wanted logprob needs the
    # logits of the position before it (scoring asks for the query after a shared document).
    prompt_logprobs_last: int | None = None
    # Embedding instead of generation: the prompt's final hidden states pooled ("mean" over its
    # tokens, or the "last" token's) and L2-normalised; nothing is generated.
    pooling: str | None = None
    logit_bias: dict[int, float] | None = None      # added to the token's logit before sampling, in [-100, 100]
    allowed_token_ids: list[int] | None = None      # only these tokens may be sampled
    bad_words: list[str] | None = None              # never generate these words (tokenized by the engine)
    truncate_prompt_tokens: int | None = None       # keep only the prompt's last k tokens
    detokenize: bool = True                          # False: token ids only (text stays empty)
    # Offline only: callables f(output_token_ids, logits_row) -> logits_row, applied in order before
    # sampling (vLLM's older logits_processors); they cannot cross a process boundary.
    logits_processors: list | None = field(default=None, repr=False)
    # bad_words as token sequences (set by the engine from bad_words; also settable directly)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # The output must match this (a JSON schema, a regex, a choice, a grammar): see structured.py.
    structured_outputs: StructuredOutputsParams | None = None
    # Seconds this request may wait for its first scheduling; past it, it fails with a queue
    # timeout instead of running late (capped by the engine's max_queue_time; see scheduler/deadlines.py).
    max_queue_time: float | None = None
    # Filled by the engine from the model's generation config; not a user field in vLLM either.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                                      "stop_token_ids")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.eos_token_ids = tuple(self.eos_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidRequestError(msg, param)

        # Type checks come first in each condition so that a wrong type gets this error (a
        # ValueError naming the parameter), not a TypeError from the comparison.
        check(_is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        check(self.best_of is None or (_is_int(self.best_of) and self.n <= self.best_of <= 64),
              "best_of", f"best_of must be an integer in [n, 64], got {self.best_of!r}")
        check(_is_real(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(_is_real(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        check(_is_real(self.repetition_penalty) and lo <= self.repetition_penalty <= hi,
              "repetition_penalty", f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty!r}")
        check(_is_real(self.temperature) and 0.0 <= self.temperature <= 100.0,
              "temperature", f"temperature must be in [0, 100], got {self.temperature!r}")
        check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
              "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        check(_is_int(self.top_k) and self.top_k >= 0,
              "top_k", f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k!r}")
        check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0,
              "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        check(self.seed is None or _is_int(self.seed), "seed", f"seed must be an integer, got {self.seed!r}")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0,
              "min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens",
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= _MAX_LOGPROBS),
              "logprobs", f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs!r}")
        check(self.pooling in (None, "mean", "last"), "pooling", f"pooling must be mean or last, got {self.pooling!r}")
        check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_real(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items())),
            "logit_bias", "logit_bias must map token ids to biases in [-100, 100]")
        check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
              "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        check(self.bad_words is None or (isinstance(self.bad_words, list)
                                         and all(isinstance(w, str) and w for w in self.bad_words)),
              "bad_words", "bad_words must be a list of non-empty strings")
        check(self.logits_processors is None or (isinstance(self.logits_processors, list)
                                                 and all(callable(f) for f in self.logits_processors)),
              "logits_processors", "logits_processors must be a list of callables")
        check(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens)
                                                      and self.truncate_prompt_tokens >= 1),
              "truncate_prompt_tokens",
              f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                               and 0 <= self.prompt_logprobs <= _MAX_LOGPROBS),
              "prompt_logprobs", f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        check(self.prompt_logprobs_last is None or (_is_int(self.prompt_logprobs_last)
                                                    and self.prompt_logprobs_last >= 1),
              "prompt_logprobs_last",
              f"prompt_logprobs_last must be an integer >= 1, got {self.prompt_logprobs_last!r}")
        check(self.max_queue_time is None or (_is_real(self.max_queue_time) and self.max_queue_time > 0),
              "max_queue_time", f"max_queue_time must be a number of seconds > 0, got {self.max_queue_time!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS,
              "stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
              "stop", f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, got one of "
              f"{max(map(len, self.stop), default=0)}")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "stop_token_ids must be non-negative integers")
        check(all(_is_int(t) and t >= 0 for t in self.eos_token_ids),
              "eos_token_ids", "eos_token_ids must be non-negative integers")

    @property
    def sampling_type(self) -> SamplingType:
        return SamplingType.GREEDY if self.temperature < SAMPLING_EPS else SamplingType.RANDOM

    @property
    def num_seqs(self) -> int:
        """Sequences the engine runs for this request (best_of, else n)."""
        return self.best_of or self.n

    @property
    def needs_logprobs(self) -> bool:
        """The sampled tokens' logprobs are computed: asked for, or needed to rank best_of samples."""
        return self.logprobs is not None or self.num_seqs > self.n

    @property
    def has_logit_edits(self) -> bool:
        """logit_bias, allowed_token_ids or bad words: applied to the row's logits before sampling."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids or self.logits_processors)

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def checked_copy(self) -> SamplingParams:
        """A copy, checked again: fields may have been set after construction (InvalidRequestError)."""
        params = copy.deepcopy(self)
        params._validate()
        return params

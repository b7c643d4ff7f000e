"""Input processing, once, in the front end: a prompt -> token ids -> a validated request.

Runs in the caller's process (the server's for ``conveyor serve``, the caller's for ``LLM``):
tokenization, the prompt's shape and length, token ids inside the vocabulary, stop strings and
grammars compiled (so that a bad one is the caller's error, not the engine's). The engine core
then only asserts the structure it relies on. No torch here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from conveyor.engine.stop_strings import compile_stops
from conveyor.errors import InvalidRequestError
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import GrammarBackend


@dataclass(slots=True)
class ProcessedInput:
    """A prompt tokenized and validated, with its own copy of the sampling parameters."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None   # shares prefix-cache blocks only with requests of the same salt


def cache_salt(prompt: object) -> str | None:
    """A dict prompt's "cache_salt" (vLLM's): a non-empty string, or None when not given."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}", "cache_salt")
    return salt


def grammar_backend(tokenizer, vocab_size: int):
    """The structured-output compiler for this tokenizer (llguidance loads on first use)."""
    return GrammarBackend(tokenizer.backend.to_str(), list(tokenizer.eos_token_ids), vocab_size)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as the tokens it is generated as: alone, and after a space (as vLLM does)."""
    out = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                     grammars=None) -> None:
    """InvalidRequestError with a clear message, and the parameter at fault, if the request can never
    run on this engine."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, {n - max_model_len + 1} more than the context of "
            f"{max_model_len} tokens allows (prompt + at least one generated token; the limit is the "
            f"smaller of the model's context and the KV cache)", "prompt", "context_length_exceeded")
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"{name} token ids must be in [0, {vocab_size})", name)
    if params.stop:
        compile_stops(tuple(params.stop))   # built here (the caller's thread), cached for the engine's
    if params.structured_outputs is not None and grammars is not None:
        try:
            grammars.validate(params.structured_outputs)   # the engine compiles it, once
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from e


def token_id_list(ids: object) -> list[int]:
    """A list of int token ids, or InvalidRequestError (no bools, no floats: 3.0 is not a token id)."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}",
                                  "prompt")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(f"prompt_token_ids must be a list of integers, got an element {t!r}",
                                      "prompt")
        out.append(int(t))
    return out



class InputProcessor:
    """Tokenize and validate prompts for one model (its vocabulary, context and end tokens)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: list[int], grammars=None,
                 default_params: SamplingParams | None = None):
        self.tokenizer = tokenizer
        # a prompt given without SamplingParams gets these: the model's defaults (conveyor/sampling/defaults.py)
        self.default_params = default_params or SamplingParams()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars   # a sampling.structured.GrammarBackend (structured outputs), or None

    def process(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                validated: bool = False) -> ProcessedInput:
        """Tokenize and validate a prompt; raises InvalidRequestError (a ValueError) saying why it cannot run.
        validated=True: the caller already ran ``validate`` on these token ids and parameters."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = (params or self.default_params).clone()
        params.eos_token_ids = self.eos_token_ids
        text, ids = self._prompt(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            text, ids = None, ids[-params.truncate_prompt_tokens:]
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if not validated:
            self.validate(ids, params)
        return ProcessedInput(text, ids, params, cache_salt(prompt))

    def _prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise InvalidRequestError(f"'prompt' must be a string, got {type(text).__name__}", "prompt")
                return text, token_id_list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'", "prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, token_id_list(prompt)
        raise InvalidRequestError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                                  f"'prompt_token_ids'; got {type(prompt).__name__}", "prompt")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError with a clear message if the request can never run."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.grammars)

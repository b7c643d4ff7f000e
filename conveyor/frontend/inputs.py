"""Input processing, once, in the front end: a prompt -> token ids -> a ProcessedRequest.

One ``InputProcessor`` per engine client, called by every API route (through server/inputs.py's
``process_request``, with the route's parameter names) and by ``LLM``. It runs in the caller's
process (the server's for ``conveyor serve``, the caller's for ``LLM``): tokenization, truncation,
the prompt's shape and length against the context, max_tokens under the API's rules, token ids
inside the vocabulary, stop strings and grammars compiled (so that a bad one is the caller's error,
not the engine's). A refusal is an InvalidRequestError naming the parameter (and a code). The engine
core then only asserts the structure it relies on. No torch here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from conveyor.frontend.stop_strings import compile_stops
from conveyor.errors import InvalidRequestError
from conveyor.lora.request import LoRARequest
from conveyor.sampling.params import SamplingParams
from conveyor.sampling.structured import GrammarBackend


@dataclass(slots=True)
class Prompt:
    """A prompt already tokenized by its caller (a chat template rendered and encoded by the server)."""

    text: str | None
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class ApiNames:
    """How an API route names the fields input processing may refuse (the error's ``param``), and that
    it follows the API's rules: a prompt plus max_tokens longer than the context is refused (offline,
    generation stops at the context instead), a missing max_tokens is what the context leaves (capped
    by the model's default max_tokens)."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A prompt tokenized and validated for one engine, with its own copy of the sampling parameters:
    what ``add_request`` accepts without checking again (the type says it was processed)."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None   # shares prefix-cache blocks only with requests of the same salt
    tenant: str = ""                # who it is served for (the scheduler's fairness between tenants)
    lora: LoRARequest | None = None  # the LoRA adapter it runs under (None: the base model)


def cache_salt_of(prompt: object, given: str | None = None) -> str | None:
    """The request's cache salt (vLLM's; `given`, else a dict prompt's "cache_salt"): a non-empty string,
    or None when not given."""
    salt = given if given is not None else prompt.get("cache_salt") if isinstance(prompt, dict) else None
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
    """Every check a request gets before it reaches an engine, for one model (its vocabulary, context
    and end tokens), in one place: every API route and ``LLM`` call it. Raises InvalidRequestError
    (param, code) saying why a request cannot run."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: list[int], grammars=None,
                 generation_defaults: dict | None = None):
        self.tokenizer = tokenizer
        # a prompt given without SamplingParams gets the model's defaults (conveyor/sampling/defaults.py)
        self.generation_defaults = dict(generation_defaults or {})
        self.default_params = SamplingParams(**self.generation_defaults)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = grammars   # a sampling.structured.GrammarBackend (structured outputs), or None

    def process(self, prompt: str | list[int] | dict | Prompt, params: SamplingParams | None = None, *,
                cache_salt: str | None = None, api: ApiNames | None = None) -> ProcessedRequest:
        """Tokenize (unless given a Prompt) and validate; `api`: the route's names and rules (ApiNames)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = (params or self.default_params).checked_copy()   # checked again: it may have changed since
        params.eos_token_ids = self.eos_token_ids
        text, ids = self._prompt(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            text, ids = None, ids[-params.truncate_prompt_tokens:]   # the text no longer matches
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        try:
            validate_request(ids, params, self.vocab_size, self.max_model_len, self.grammars)
        except InvalidRequestError as e:
            raise e.renamed(api.prompt) if api is not None and e.param == "prompt" else e
        if api is not None:
            self._fit_max_tokens(len(ids), params, api)
        return ProcessedRequest(text, ids, params, cache_salt_of(prompt, cache_salt))

    def _fit_max_tokens(self, n: int, params: SamplingParams, api: ApiNames) -> None:
        limit = self.max_model_len
        if params.max_tokens is None:
            params.max_tokens = min(limit - n, self.generation_defaults.get("max_tokens", limit - n))
        elif n + params.max_tokens > limit:
            raise InvalidRequestError(
                f"this server's context is {limit} tokens, but {n + params.max_tokens} were requested ({n} in "
                f"the prompt, {params.max_tokens} for the completion): {n + params.max_tokens - limit} too "
                f"many; reduce the prompt or {api.max_tokens}", api.max_tokens, "context_length_exceeded")

    def check_text_size(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit the context whatever its tokens, before tokenizing it: no token is
        longer than the vocabulary's longest, so it has at least chars / that many tokens."""
        longest = self.tokenizer.max_token_chars
        least = -(-chars // longest)
        if least >= self.max_model_len:
            raise InvalidRequestError(
                f"the input has {chars} characters, so at least {least} tokens (no token of this model is "
                f"longer than {longest} characters): more than this server's context of {self.max_model_len} "
                f"tokens", param, "context_length_exceeded")

    def _prompt(self, prompt: str | list[int] | dict | Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Prompt):
            return prompt.text, token_id_list(prompt.token_ids)
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

"""Structured outputs: a grammar per request, turned into a token mask applied in the batched sampler.

``StructuredOutputsParams`` says what the output must match (one of a JSON schema, any JSON
object, a regex, a choice of strings, or a Lark/GBNF grammar), as vLLM's class of that name.
``GrammarBackend`` compiles it with llguidance (chosen by measurement: docs/structured-outputs.md)
into a matcher per sequence, caches compiled grammars by their text, and fills the step's token
bitmasks for all constrained rows in one parallel call (llguidance's Rust threads, GIL released).
The sampler sets disallowed logits to the lowest finite value before temperature, penalties, top-k/p and argmax, so
every sampled token keeps the output inside the grammar; when the grammar is complete, only EOS
(or nothing: the request stops) is allowed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from conveyor.errors import InvalidRequestError

logger = logging.getLogger(__name__)

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# One space after ',' and ':' and no other whitespace (a schema's "x-guidance" can override): free
# whitespace lets a small model wander into blank lines until max_tokens cuts the JSON short.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256


def _invalid(message: str) -> InvalidRequestError:
    """A bad constraint, named as the structured_outputs parameter (a front end may rename it)."""
    return InvalidRequestError(message, "structured_outputs")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names)."""

    json: dict | bool | str | None = None   # a JSON schema (dict or its text; true: any JSON)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None              # Lark (llguidance's dialect) or GBNF (has "::=")
    json_object: bool | None = None         # any JSON object

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _invalid(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                           f"{', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise _invalid("structured_outputs.choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise _invalid(f"structured_outputs.json is not valid JSON: {e}") from e
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise _invalid("structured_outputs.json must be a JSON schema (an object)")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical text of the constraint: the compile cache's key."""
        value = getattr(self, self.kind)
        return self.kind + ":" + (json.dumps(value, sort_keys=True) if not isinstance(value, str) else value)

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form) for this constraint."""
        from llguidance import LLMatcher, gbnf_to_lark   # lazy: keeps llguidance out of the CLI's start-up

        kind = self.kind
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_STYLE)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            # Lark string literals take JSON escapes: any choice text is matched literally.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        text = self.grammar
        return LLMatcher.grammar_from_lark(gbnf_to_lark(text) if "::=" in text else text)


class GrammarBackend:
    """Compiles constraints for one tokenizer; makes per-sequence matchers; fills token bitmasks."""

    def __init__(self, tokenizer_json: str, eos_token_ids: list[int], vocab_size: int):
        self._tokenizer_json = tokenizer_json
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._tok = None
        self._executor = None
        self._lock = threading.Lock()   # the caller's thread compiles; the engine's thread too
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.compiles = 0

    def _tokenizer(self):
        if self._tok is None:   # ~0.2 s for a 49k vocabulary: only once something is constrained
            from llguidance import LLExecutor, LLTokenizer   # lazy: keeps llguidance out of the CLI's start-up

            self._tok = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
            self._executor = LLExecutor()
        return self._tok

    def compile(self, params: StructuredOutputsParams):
        """The compiled prototype matcher (cached by the constraint's text); ValueError if invalid."""
        from llguidance import LLMatcher   # lazy: keeps llguidance out of the CLI's start-up

        key = params.key()
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                return proto
            tok = self._tokenizer()
        try:
            grammar = params.to_grammar()
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from e
        proto = LLMatcher(tok, grammar, log_level=0)
        if proto.is_error():
            raise ValueError(f"structured_outputs: the {params.kind} constraint cannot be compiled: "
                             f"{proto.get_error()}")
        with self._lock:
            self.compiles += 1
            self._cache[key] = proto
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return proto

    def validate(self, params: StructuredOutputsParams) -> None:
        """ValueError if the constraint cannot be compiled; the front end's check, without building
        the matcher (the engine core compiles it, once, when the request arrives there)."""
        from llguidance import LLMatcher   # lazy: keeps llguidance out of the CLI's start-up

        if params.key() in self._cache:
            return
        try:
            grammar = params.to_grammar()
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from e
        with self._lock:
            tok = self._tokenizer()
        error = LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise ValueError(f"structured_outputs: the {params.kind} constraint cannot be compiled: {error}")

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one sequence (a copy of the cached compiled grammar)."""
        return self.compile(params).deep_copy()

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    # ---- the step: the engine core calls these two, and nothing else of structured outputs ----
    def step_masks(self, plan: Any, requests: dict) -> None:
        """Set the plan's allowed-token bitmasks for its constrained sequences that sample this
        step (``plan.grammar_ids``: row i's request), in one parallel call. A sequence with
        speculative drafts gets a row per position (its id repeated): the mask after each draft."""
        ids, matchers, drafts = [], [], []
        for s in plan.scheduled:
            request = requests.get(s.request_id) if s.sample else None
            if request is not None and request.grammar is not None:
                proposed = s.draft_token_ids
                ids += [s.request_id] * (1 + len(proposed))
                matchers.append(request.grammar)
                drafts.append(proposed)
        if matchers:
            plan.grammar_ids = ids
            plan.grammar_bitmask = self.fill_bitmasks(matchers, drafts)

    @staticmethod
    def accept(tokens: dict[str, list[int]], requests: dict) -> None:
        """Feed each constrained sequence the tokens it got this step, in order (more than one where
        speculative drafts were accepted). A grammar that refuses one, or that can take nothing
        more, marks the request ``grammar_ended`` after that token (``grammar_end``: the scheduler's
        finish check then stops it there: scheduler/stopping.py)."""
        for rid, new in tokens.items():
            request = requests.get(rid)
            if request is None or request.grammar is None:
                continue
            for i, token in enumerate(new):
                if token in request.params.eos_token_ids:
                    continue   # an end token ends the request itself (a grammar may refuse it: no warning)
                if not request.grammar.consume_token(token):
                    logger.warning("request %s: token %d rejected by its grammar (%s); stopping it", rid, token,
                                   request.grammar.get_error())
                elif not request.grammar.is_stopped():
                    continue
                # refused, or nothing but the end can follow
                request.grammar_ended = True
                request.grammar_end = request.num_output_tokens + i + 1
                break

    def fill_bitmasks(self, matchers: list, drafts: list[list[int]] | None = None) -> Any:
        """An int32 tensor ``[rows, ceil(vocab / 32)]``: bit t of row i set = token t allowed; a row per
        matcher, or with `drafts` (speculative decoding) 1 + len(drafts[i]) consecutive rows per
        matcher: its mask now and after each of its drafts (the matcher is left as it was)."""
        import torch   # lazy: keeps torch out of the torch-free units

        drafts = drafts or [[]] * len(matchers)
        rows = sum(1 + len(d) for d in drafts)
        mask = torch.empty((rows, self.mask_words), dtype=torch.int32)
        plain, drafted, row = [], [], 0
        for m, d in zip(matchers, drafts):
            if d:   # (llguidance's draft call takes only non-empty drafts)
                drafted.append((m, row, list(d)))
            else:
                plain.append((m, row))
            row += 1 + len(d)
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), self.mask_words * 4, rows)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, mask.data_ptr(), self.mask_words * 4,
                                                                    rows)
        empty = (mask == 0).all(dim=1).nonzero().flatten().tolist()
        for i in empty:   # a matcher with no way on (should not happen): let it end rather than fail the step
            for t in self._eos:
                mask[i, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
        return mask


def apply_bitmask(logits: Any, rows: list[int], bitmask: Any) -> None:
    """In place: logits[rows[i], t] = the dtype's lowest value where bit t of bitmask[i] is clear."""
    import torch   # lazy: keeps torch out of the torch-free units

    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab]
    if allowed.shape[1] < vocab:   # ids beyond the tokenizer's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    # The lowest finite value, not -inf: the greedy kernel treats any non-finite logit as a broken row.
    sub.masked_fill_(~allowed.to(logits.device), torch.finfo(logits.dtype).min)
    logits.index_copy_(0, index, sub)

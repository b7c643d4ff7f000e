"""Engine logprobs ({token_id: logprob} per generated token) in the two OpenAI formats."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import decoders

from conveyor.server.protocol import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from conveyor.tokenizer import Tokenizer


class TokenTexts:
    """Token id -> its text and raw bytes, memoised (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self.text = lru_cache(maxsize=1 << 16)(tokenizer.id_to_token_str)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> list[int]:
        # A byte-level BPE token spells its exact bytes (a lone piece of a UTF-8 character too);
        # otherwise fall back to the UTF-8 of its decoded text.
        if self._byte_level:
            piece = self.tokenizer.backend.id_to_token(token_id)
            dec = _byte_decoder()
            if piece is not None and all(ch in dec for ch in piece):
                return [dec[ch] for ch in piece]
        return list(self.text(token_id).encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100+."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        num_top: int, offset: int = 0) -> tuple[CompletionLogprobs, int]:
    """Legacy format; `offset` is the text offset of the first token. Returns the next offset too."""
    out = CompletionLogprobs()
    for tid, entry in zip(token_ids, logprobs):
        tok = texts.text(tid)
        out.tokens.append(tok)
        out.token_logprobs.append(entry.get(tid) if entry else None)
        # The top `num_top` plus the sampled token, as the API documents (up to logprobs + 1).
        top = dict(_top(entry, num_top)) if entry else {}
        if entry and tid in entry:
            top.setdefault(tid, entry[tid])
        out.top_logprobs.append({texts.text(t): lp for t, lp in top.items()} if entry else None)
        out.text_offset.append(offset)
        offset += len(tok)
    return out, offset


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float] | None],
                  num_top: int) -> list[ChatTokenLogprob]:
    out = []
    for tid, entry in zip(token_ids, logprobs):
        entry = entry or {}
        out.append(ChatTokenLogprob(
            token=texts.text(tid), logprob=entry.get(tid, float("-inf")), bytes=texts.bytes(tid),
            top_logprobs=[ChatTopLogprob(token=texts.text(t), logprob=lp, bytes=texts.bytes(t))
                          for t, lp in _top(entry, num_top)]))
    return out

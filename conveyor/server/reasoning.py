"""Reasoning parsers (``--reasoning-parser``): split a model's ``<think>…</think>`` reasoning from
its answer, incrementally (a stream's deltas) or at once (the same code over the whole text, so
the two always agree).

- ``qwen3``: the output is reasoning only when it opens with ``<think>`` or the prompt already
  opened one (a template that ends the generation prompt with ``<think>``); Qwen3's
  ``enable_thinking=False`` template closes an empty block in the prompt, so the output is all
  content. An unclosed block (cut by max_tokens) is all reasoning.
- ``deepseek_r1``: the output starts inside the reasoning whatever the prompt says (R1's template
  opens the block in the prompt; a leading ``<think>`` in the output is dropped); everything up
  to ``</think>`` is reasoning, and with no ``</think>`` the whole output is.

Whitespace between ``</think>`` and the answer is not part of the answer. A constrained output
(a grammar from the first token) is read without the parser, unless its regex or grammar itself
spells ``</think>`` (`parser_for`).
"""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def parser_for(parser: str | None, params: object) -> str | None:
    """The reasoning parser to read a request's output with: none when a grammar constrains the
    output (tool_choice required/named, response_format, structured outputs): the grammar holds
    from the first token, so the output has no reasoning block and is all answer — unless the
    constraint itself writes the end of the reasoning (a regex or grammar spelling ``</think>``)."""
    constraint = getattr(params, "structured_outputs", None)
    if parser is None or constraint is None:
        return parser
    spelled = " ".join(str(getattr(constraint, k, None) or "") for k in ("regex", "grammar"))
    return parser if END in spelled else None


def opened_in_prompt(prompt_text: str | None) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` block open for the output to continue."""
    if not prompt_text:
        return False
    start, end = prompt_text.rfind(START), prompt_text.rfind(END)
    return start > end and not prompt_text[start + len(START):].strip()


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back: the
    next delta may complete the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkSplitter:
    """Feed the output's text as it grows; get (reasoning, content) pieces, in order."""

    def __init__(self, parser: str, prompt_text: str | None = None):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(PARSERS)}")
        self._state = "reasoning" if parser == "deepseek_r1" or opened_in_prompt(prompt_text) else "start"
        self._strip_start = self._state == "reasoning"   # a leading <think> in the output is dropped
        self._buf = ""
        self._content_started = False

    def feed(self, delta: str, finished: bool = False) -> list[tuple[str, str]]:
        """[("reasoning" | "content", text), ...] for this delta; `finished` flushes what was held back."""
        self._buf += delta
        out: list[tuple[str, str]] = []
        while True:
            buf = self._buf
            if self._state == "start" or self._strip_start:
                head = buf.lstrip()
                if head.startswith(START):
                    self._buf, self._state, self._strip_start = head[len(START):], "reasoning", False
                    continue
                if START.startswith(head) and not finished:
                    return out   # perhaps the start of <think>: wait for more
                self._state = "content" if self._state == "start" else self._state
                self._strip_start = False
                continue
            if self._state == "reasoning":
                i = buf.find(END)
                if i >= 0:
                    if i:
                        out.append(("reasoning", buf[:i]))
                    self._buf, self._state = buf[i + len(END):], "content"
                    continue
                keep = 0 if finished else partial_suffix(buf, END)
                if len(buf) > keep:
                    out.append(("reasoning", buf[:len(buf) - keep]))
                self._buf = buf[len(buf) - keep:]
                return out
            # content: drop the whitespace between </think> and the answer
            if not self._content_started:
                buf = buf.lstrip()
                if not buf:
                    self._buf = ""
                    return out
                self._content_started = True
            if buf:
                out.append(("content", buf))
            self._buf = ""
            return out


def split_reasoning(text: str, parser: str, prompt_text: str | None = None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    reasoning, content = [], []
    for kind, piece in ThinkSplitter(parser, prompt_text).feed(text, finished=True):
        (reasoning if kind == "reasoning" else content).append(piece)
    return ("".join(reasoning) if reasoning else None), "".join(content)

"""A chat output read as the API shows it: reasoning, content and tool calls, incrementally.

One `OutputStream` per choice is fed the output's text deltas and returns typed events: reasoning
text (``--reasoning-parser``), content text and tool calls — a call's start (id, name) as soon
as its name is complete and its arguments as they are generated (the ``hermes`` parser streams
the arguments' JSON text verbatim; the ``json`` parser, whose whole output is the call, sends
them when the output ends). `parse_output` runs the same stream over a whole output, so a
streamed answer and a non-streamed one agree on every complete output. Two cases cannot: a call
cut by max_tokens after its name was sent, and a block read as a call (name first, then an
object) that turns out not to be valid JSON when it closes — a stream has announced the call
(its arguments incomplete or invalid) before the end shows it; the whole output has no such call
(the invalid block is content). Arguments given as a JSON-encoded string are sent whole at the
block's close (the string's content).

With tools in play, content is what lies outside ``<tool_call>`` blocks, with surrounding
whitespace dropped; a block cut by max_tokens is neither content nor a call (no markup leaks
into the message); a block that is not a valid call is content, as the model wrote it.
Every chat-shaped API (chat completions, Responses, Anthropic messages) reads outputs here.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.server.reasoning import ThinkSplitter, partial_suffix
from conveyor.server.tools import ToolPlan, parse_tool_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A call whose name comes first can stream its arguments: {"name": "...", "arguments": <value>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolArgsDelta:
    index: int
    text: str


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolArgsDelta


@dataclass(slots=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonValueEnd:
    """Finds where one JSON value ends in text that arrives piece by piece."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.started = 0, False, False, False

    def scan(self, text: str) -> int:
        """Index just past the value's end within `text`, or -1 if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if ch == '"':
                self.in_string, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and self.started and (ch in ", \n\t\r"):
                return i   # a bare scalar (number, true, null) ended
            elif not ch.isspace():
                self.started = True
        return -1


class OutputStream:
    """Feed one choice's text deltas; get reasoning / content / tool-call events."""

    def __init__(self, tools: ToolPlan | None, reasoning_parser: str | None = None, prompt_text: str | None = None):
        self._tools = tools if tools is not None and tools.active else None
        self._think = ThinkSplitter(reasoning_parser, prompt_text) if reasoning_parser else None
        self.calls: list[dict[str, Any]] = []
        self._text = ""            # content text not yet decided (tools in play)
        self._in_call = False
        self._body = ""            # the current <tool_call> block's text
        # the open block's streamed call: (index, scanner of its arguments or None once they ended,
        # position in the block up to which they were read)
        self._streaming: tuple[int, _JsonValueEnd | None, int] | None = None
        self._args, self._call_id, self._name = "", "", ""
        self._whole = False        # the open block is read when it closes (its arguments are not an object)
        self._announced = 0        # calls announced (ToolCallStart) so far: the next one's index
        self._pending_ws = ""      # whitespace between pieces of content, sent once more content follows
        self._content_started = False
        self._ended = False

    def feed(self, delta: str, finished: bool = False) -> list[Event]:
        if self._ended:
            return []
        self._ended = finished
        pieces = self._think.feed(delta, finished) if self._think is not None else [("content", delta)]
        out: list[Event] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(ReasoningDelta(text))
            else:
                out.extend(self._content(text))
        if finished and self._tools is not None:
            out.extend(self._content("", final=True))
        return out

    # ---- content and tool calls ---------------------------------------------------------------

    def _content(self, text: str, final: bool = False) -> list[Event]:
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        if self._tools.parser == "json":   # the whole output is the call: decided at the end
            self._text += text
            return self._json_calls() if final else []
        self._text += text
        out: list[Event] = []
        while True:
            if self._in_call:
                if not self._call_step(out, final):
                    return out
                continue
            i = self._text.find(OPEN)
            if i >= 0:
                self._say(out, self._text[:i])
                self._text, self._in_call, self._body = self._text[i + len(OPEN):], True, ""
                continue
            keep = 0 if final else partial_suffix(self._text, OPEN)
            self._say(out, self._text[:len(self._text) - keep])
            self._text = self._text[len(self._text) - keep:]
            return out

    def _say(self, out: list[Event], text: str) -> None:
        """Content outside the calls, with leading / trailing / between-call whitespace held back
        until more content follows (so a message of calls alone has no content)."""
        if not text:
            return
        if not text.strip():
            if self._content_started:
                self._pending_ws += text
            return
        if not self._content_started:
            text, self._content_started = text.lstrip(), True
        body = text.rstrip()
        out.append(ContentDelta(self._pending_ws + body))
        self._pending_ws = text[len(body):]

    def _call_step(self, out: list[Event], final: bool) -> bool:
        """Advance the open <tool_call> block; True when it closed (more text may follow)."""
        self._body += self._text
        self._text = ""
        if self._streaming is None and not self._whole:
            m = _HEAD.match(self._body)
            if m is not None:
                value = self._body[m.end():].lstrip()
                if not value.startswith("{"):   # not an object (a JSON-encoded string, ...): read at the close
                    self._whole = bool(value)
                else:
                    name = json.loads(m.group(1))
                    index, call_id = self._announced, new_call_id()
                    self._announced += 1
                    out.append(ToolCallStart(index, call_id, name))
                    self._streaming = (index, _JsonValueEnd(), m.end())
                    self._args, self._call_id, self._name = "", call_id, name
        if self._streaming is not None:
            index, scanner, pos = self._streaming
            end = self._body.find(CLOSE, pos)
            # (a partial </tool_call> at the end is held back: it is not arguments)
            chunk_end = len(self._body) - partial_suffix(self._body, CLOSE) if end < 0 else end
            if scanner is not None and not scanner.started:   # whitespace before the value is not sent
                while pos < chunk_end and self._body[pos].isspace():
                    pos += 1
            if scanner is not None and pos < chunk_end:
                piece = self._body[pos:chunk_end]
                stop = scanner.scan(piece)
                if stop >= 0:
                    piece, scanner = piece[:stop], None
                if piece:
                    out.append(ToolArgsDelta(index, piece))
                    self._args += piece
                pos = chunk_end if scanner is not None else pos + len(piece)
                self._streaming = (index, scanner, pos)
            if end < 0:
                if final:   # cut inside a call: not a call, not content
                    self._reset_call()
                return False
            block, self._text = self._body[:end], self._body[end + len(CLOSE):]
            call = {"id": self._call_id, "type": "function", "function": {"name": self._name, "arguments": self._args}}
            self._reset_call()
            if _valid_block(block, call):
                self.calls.append(call)
            else:   # announced while streaming, but not a valid call: the model's text, as written
                self._say(out, OPEN + block + CLOSE)
            return True
        end = self._body.find(CLOSE)
        if end < 0:
            if final:
                self._reset_call()   # cut before its name: dropped
            return False
        block, self._text = self._body[:end], self._body[end + len(CLOSE):]
        self._reset_call()
        _, calls = parse_tool_calls(OPEN + block + CLOSE, "hermes")
        if not calls:   # not a valid call: the model's text, as written
            self._say(out, OPEN + block + CLOSE)
            return True
        call = calls[0]
        index = self._announced
        self._announced += 1
        out.append(ToolCallStart(index, call["id"], call["function"]["name"]))
        out.append(ToolArgsDelta(index, call["function"]["arguments"]))
        self.calls.append(call)
        return True

    def _reset_call(self) -> None:
        self._in_call, self._body, self._streaming, self._args, self._whole = False, "", None, "", False

    def _json_calls(self) -> list[Event]:
        content, calls = parse_tool_calls(self._text, "json")
        out: list[Event] = []
        if not calls:
            self._say(out, self._text)
            return out
        for call in calls:
            index = self._announced
            self._announced += 1
            out += [ToolCallStart(index, call["id"], call["function"]["name"]),
                    ToolArgsDelta(index, call["function"]["arguments"])]
            self.calls.append(call)
        return out


def _valid_block(block: str, call: dict[str, Any]) -> bool:
    """Whether a streamed block is the call it was read as: one JSON object with that name and an
    object of arguments, nothing after it."""
    try:
        value, args = json.loads(block), json.loads(call["function"]["arguments"])
    except ValueError:
        return False
    return (isinstance(value, dict) and value.get("name") == call["function"]["name"]
            and isinstance(value.get("arguments"), dict) and args == value["arguments"])


def parse_output(text: str, tools: ToolPlan | None, reasoning_parser: str | None = None,
                 prompt_text: str | None = None) -> ParsedOutput:
    """A whole output read as `OutputStream` reads it streamed."""
    stream = OutputStream(tools, reasoning_parser, prompt_text)
    reasoning: list[str] = []
    content: list[str] = []
    for e in stream.feed(text, finished=True):
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
    return ParsedOutput("".join(reasoning) if reasoning else None, "".join(content) if content else None,
                        stream.calls)

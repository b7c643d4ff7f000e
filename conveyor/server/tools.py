"""Tool calling for /v1/chat/completions: tools into the prompt, tool calls out of the text.

- The tools reach the model through its chat template when the template uses ``tools``; else
  a default system prompt (Hermes style, which most open chat models were trained on) lists
  them as JSON and asks for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
  History messages work with any template: an assistant message's ``tool_calls`` (with
  ``content: null``) become ``<tool_call>`` blocks, a ``role: "tool"`` message becomes a
  ``<tool_response>`` block, unless the template handles them itself.
- ``tool_choice``: ``none`` (tools not shown, nothing parsed), ``auto`` (shown; calls parsed out
  of free text), ``required`` and a named function: the output is constrained with a grammar
  (structured outputs) to one or more well-formed calls of the allowed functions whose
  ``arguments`` match their JSON schema — so it works even on a 135M model. The schema is read
  strictly: an object that lists its ``properties`` gets no other keys unless it says
  ``additionalProperties`` (see `strict_objects`).
- Parsers (``--tool-call-parser``): ``hermes`` (``<tool_call>`` blocks; text outside them is the
  message content) and ``json`` (the whole output is one call object or a list of them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from conveyor.sampling.structured import JSON_STYLE, StructuredOutputsParams
from conveyor.server.config import TOOL_CALL_PARSERS
from conveyor.server.errors import bad_request

PARSERS = TOOL_CALL_PARSERS
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

DEFAULT_TOOL_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user "
    "query. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for its prompt, sampling and response."""

    tools: list[dict[str, Any]]           # the function definitions offered to the model
    choice: str                           # none | auto | required | named
    parallel: bool
    parser: str
    constraint: StructuredOutputsParams | None = None

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)


def plan_tools(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool | None,
               parser: str = "hermes") -> ToolPlan | None:
    """Validate tools / tool_choice (400s naming the field) and decide what to do with them."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    choice = tool_choice if tool_choice is not None else "auto"
    allowed = functions
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise bad_request(f"tool_choice names a function that is not in tools: {name!r}", "tool_choice")
        allowed, choice = [f for f in functions if f["name"] == name], "named"
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                          "tool_choice")
    par = True if parallel is None else bool(parallel)
    plan = ToolPlan([{"type": "function", "function": f} for f in functions], choice, par, parser)
    if choice in ("required", "named"):
        plan.constraint = StructuredOutputsParams(grammar=call_grammar(allowed, par and choice == "required",
                                                                       parser))
    return plan


def call_grammar(functions: list[dict], many: bool, parser: str) -> str:
    """A Lark grammar (llguidance dialect, with inline %json schemas) for calls of these functions."""
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      "arguments": strict_objects(f["parameters"])},
                      "required": ["name", "arguments"], "additionalProperties": False} for f in functions],
           "x-guidance": JSON_STYLE}
    if parser == "json":
        body = {"type": "array", "items": one, "minItems": 1, "x-guidance": JSON_STYLE} if many else one
        return "start: %json " + json.dumps(body)
    call = 'call: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json ' + json.dumps(one)
    return ('start: call ("\\n" call)*\n' if many else "start: call\n") + call


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples", "required")


def strict_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema that lists its
    ``properties`` and says nothing about other keys: a tool's arguments hold only the keys its
    schema declares (JSON Schema would allow any others, and small models then invent keys).
    An object schema without ``properties`` (a free-form dict), an explicit
    ``additionalProperties`` and the branches of ``allOf`` / ``not`` are left as they are."""
    if isinstance(schema, list):
        return [strict_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):   # name -> schema maps: the names are not keywords
            out[k] = {name: strict_objects(sub) for name, sub in v.items()}
        elif k in ("allOf", "not"):   # closing one branch of a conjunction would forbid the others' keys
            out[k] = v
        else:
            out[k] = v if k in _VALUES else strict_objects(v)
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def render_messages(messages: list[dict[str, Any]], template: str, plan: ToolPlan | None) -> tuple[list[dict], Any]:
    """(messages for the template, `tools` for the template): tool history made template-safe, and
    the tools listed in a system prompt when the template does not take them itself."""
    handles_calls = "tool_calls" in template
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls") and not handles_calls:
            blocks = []
            for call in m.pop("tool_calls"):
                fn = call.get("function", {}) if isinstance(call, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                blocks.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) +
                              "\n</tool_call>")
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        elif m.get("role") == "tool" and not handles_calls:
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if plan is None or plan.choice == "none":
        return out, None
    if "tools" in template:
        return out, plan.tools
    listing = "\n".join(json.dumps(t["function"]) for t in plan.tools)
    prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(message content, OpenAI tool_calls) from a model's output; no calls: (text, [])."""
    calls: list[dict[str, Any]] = []
    if parser == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in items):
            return text, []
        return None, [_call(v["name"], v.get("arguments", {})) for v in items]
    rest, last = [], 0
    for m in _CALL.finditer(text):
        try:
            v = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(v, dict) or not isinstance(v.get("name"), str):
            continue
        calls.append(_call(v["name"], v.get("arguments", v.get("parameters", {}))))
        rest.append(text[last:m.start()])
        last = m.end()
    if not calls:
        return text, []
    rest.append(text[last:])
    content = "".join(rest).strip()
    return content or None, calls


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}

"""Chat's `tools`, `tool_choice` and `parallel_tool_calls`, checked into the tools the chat
template sees and the constraint that forces a call.

`"required"` constrains the output to a JSON array of one or more calls, each
`{"name": <a tool's name>, "arguments": <that tool's parameters>}`; a named function constrains
it to that function's arguments alone. `"auto"` (OpenAI's default when tools are sent) would need
a parser that finds calls in free text, which lorad does not have: it is refused by name, never
served as `"none"` silently. tool_calls.py turns the constrained output into OpenAI's tool_calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lorad.daemon.chat_messages import text
from lorad.daemon.constraints import CONSTRAINT_FIELDS, Constraint, compile_json_schema
from lorad.daemon.errors import bad_request

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# A function without parameters takes exactly {}: an open object would let the model ramble.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_AUTO = ('send tool_choice "required" (call one or more of the tools), {"type": "function", '
         '"function": {"name": ...}} (call that one), or "none" (answer in text)')


@dataclass(frozen=True)
class ToolChoice:
    function: str | None  # the one function every answer calls; None: "required", any of them
    num_calls_max: int | None = None  # "required" with parallel_tool_calls false: 1


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict] | None  # as the template sees them: [{"type": "function", "function": ...}]
    choice: ToolChoice | None = None  # None: no call is forced (tool_choice "none")
    constraint: Constraint | None = None


def parse_tools(body: dict) -> ToolRequest:
    """-> the request's tools and forced call; a 400 naming the field for anything else."""
    tools = _tools(body.get("tools"))
    choice = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls",
                          "invalid_type")
    if choice is None:
        return ToolRequest(tools or None)
    _refuse_other_constraints(body, choice)
    by_name = {t["function"]["name"]: (i, t["function"]["parameters"])
               for i, t in enumerate(tools)}
    if choice.function is not None:
        i, parameters = by_name[choice.function]
        constraint = compile_json_schema(parameters, f"tools[{i}].function.parameters")
        return ToolRequest(tools, choice, constraint)
    choice = ToolChoice(None, 1 if parallel is False else None)
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": name}, "arguments": parameters}}
        for name, (_, parameters) in by_name.items()]}}
    if choice.num_calls_max is not None:
        calls["maxItems"] = choice.num_calls_max
    return ToolRequest(tools, choice, compile_json_schema(calls, "tools"))


def _tools(value: object) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools must be a list of function tools", "tools", "invalid_type")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"tools holds {len(value)} tools; at most {MAX_TOOLS} are accepted",
                          "tools")
    tools, seen = [], set()
    for i, tool in enumerate(value):
        tools.append(_tool(tool, f"tools[{i}]"))
        name = tools[-1]["function"]["name"]
        if name in seen:
            raise bad_request(f"tools[{i}].function.name {name!r} is the name of an earlier "
                              f"tool; names must be unique", f"tools[{i}].function.name")
        seen.add(name)
    return tools


def _tool(tool: object, where: str) -> dict:
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", where, "invalid_type")
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type must be \"function\", got {tool.get('type')!r}",
                          f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function",
                          "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1 to 64 characters of a-z, A-Z, 0-9, "
                          f"_ and -, got {name!r}", f"{where}.function.name")
    out = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string",
                              f"{where}.function.description", "invalid_type")
        out["description"] = text(description, f"{where}.function.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be a boolean",
                          f"{where}.function.strict", "invalid_type")
    out["parameters"] = _parameters(function.get("parameters"), f"{where}.function.parameters")
    return {"type": "function", "function": out}


def _parameters(value: object, where: str) -> dict:
    if value is None or value == {}:
        return NO_PARAMETERS
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be a JSON Schema object", where, "invalid_type")
    if value.get("type") != "object":
        raise bad_request(f"{where} must describe an object (\"type\": \"object\"), got "
                          f"\"type\": {value.get('type')!r}", where)
    compile_json_schema(value, where)  # refused here, whichever tool the request forces
    return value


def _choice(value: object, tools: list[dict]) -> ToolChoice | None:
    if value is None and tools:
        raise bad_request(f'tools without tool_choice means "auto", which lorad does not '
                          f'support; {_AUTO}', "tool_choice", "unsupported")
    if value is None or value == "none":
        return None
    if value == "auto":
        raise bad_request(f'tool_choice "auto" is not supported; {_AUTO}', "tool_choice",
                          "unsupported")
    if value == "required":
        if not tools:
            raise bad_request('tool_choice "required" needs tools', "tool_choice")
        return ToolChoice(None)
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request(f'tool_choice must be "none", "required" or {{"type": "function", '
                          f'"function": {{"name": ...}}}}, got {value!r}', "tool_choice")
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice.function.name must be a string",
                          "tool_choice.function.name", "invalid_type")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice.function.name {name!r} names none of the tools",
                          "tool_choice.function.name")
    return ToolChoice(name)


def _refuse_other_constraints(body: dict, choice: ToolChoice) -> None:
    forced = "required" if choice.function is None else f"function {choice.function!r}"
    for name in CONSTRAINT_FIELDS:
        if body.get(name) is not None and body.get(name) != {"type": "text"}:
            raise bad_request(f"{name} cannot be combined with tool_choice {forced}: the tool "
                              f"call is the output constraint; send one", name)
    if body.get("ignore_eos"):
        raise bad_request("ignore_eos cannot be combined with a forced tool call: the call "
                          "ends with an end-of-sequence token", "ignore_eos")
    if body.get("stop") not in (None, [], ""):
        raise bad_request("stop cannot be combined with a forced tool call: a stop string "
                          "would cut the call's JSON short", "stop")

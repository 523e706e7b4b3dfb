"""Chat's `messages`, checked into the dicts the chat template sees.

Roles system, user and assistant carry text content (a string or text parts, joined with
newlines). An assistant message may carry `tool_calls` (its content may then be null, passed as
""), each call's `arguments` JSON text parsed into the object Hugging Face templates expect; a
`tool` message answers one of those calls by its `tool_call_id`. Images, audio and other parts
are refused by name.
"""

from __future__ import annotations

import json

from lorad.daemon.errors import bad_request

CHAT_ROLES = ("system", "user", "assistant", "tool")


def parse_messages(value: object) -> list[dict]:
    if value is None:
        raise bad_request("you must provide messages", "messages", "missing_required")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages",
                          "invalid_type" if not isinstance(value, list) else "invalid_value")
    messages, call_ids = [], set()
    for i, message in enumerate(value):
        messages.append(_message(message, f"messages[{i}]", call_ids))
        call_ids.update(call["id"] for call in messages[-1].get("tool_calls", ()))
    return messages


def text(value: str, where: str, param: str | None = None) -> str:
    """A string the tokenizer can take: JSON may spell lone UTF-16 surrogates (\\ud800). param:
    the 400's field, when not `where` itself."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{where} holds an unpaired surrogate at character {exc.start}, which "
                          f"is not text", param or where) from None
    return value


def _message(message: object, where: str, call_ids: set[str]) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object", where, "invalid_type")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                          f"{where}.role")
    if role == "assistant" and message.get("tool_calls") not in (None, []):
        calls = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        content = message.get("content")
        content = "" if content is None else _content(content, f"{where}.content")
        return {"role": role, "content": content, "tool_calls": calls}
    out = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id",
                              "invalid_type" if call_id is not None else "missing_required")
        if call_id not in call_ids:
            raise bad_request(f"{where}.tool_call_id {call_id!r} answers no tool call of an "
                              f"earlier assistant message", f"{where}.tool_call_id")
        out["tool_call_id"] = text(call_id, f"{where}.tool_call_id")
    return out


def _tool_calls(value: object, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list", where, "invalid_type")
    calls = []
    for i, call in enumerate(value):
        here = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type") != "function":
            raise bad_request(f'{here} must be an object with "type": "function"', here)
        function = call.get("function")
        if not isinstance(call.get("id"), str) or not isinstance(function, dict):
            raise bad_request(f"{here} must have an id (a string) and a function (an object)",
                              here, "invalid_type")
        if not isinstance(function.get("name"), str):
            raise bad_request(f"{here}.function.name must be a string", f"{here}.function.name",
                              "invalid_type")
        arguments = function.get("arguments")
        try:
            # Templates render the arguments themselves (tojson), so they get the object.
            parsed = json.loads(text(arguments, f"{here}.function.arguments"))
        except (TypeError, AttributeError, json.JSONDecodeError):
            raise bad_request(f"{here}.function.arguments must be a string of JSON",
                              f"{here}.function.arguments") from None
        calls.append({"id": text(call["id"], f"{here}.id"), "type": "function",
                      "function": {"name": text(function["name"], f"{here}.function.name"),
                                   "arguments": parsed}})
    return calls


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return text(content, where)
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where,
                          "invalid_type")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(f"{where}[{i}]: only text parts are supported", f"{where}[{i}]",
                              "unsupported")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}].text must be a string", f"{where}[{i}].text",
                              "invalid_type")
        texts.append(text(part["text"], f"{where}[{i}].text"))
    return "\n".join(texts)  # as vLLM joins text parts for text-only models

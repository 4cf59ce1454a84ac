"""Tool calls on /v1/chat/completions: OpenAI's `tools` and `tool_choice`.

The tools reach the model's chat template as transformers gives them (`tools=[{"type":
"function", "function": {...}}]`), so the model is told of them its own way. What the model
answers depends on `tool_choice`:
  "none":      the tools are shown, the answer is text;
  "auto":      (the default) the model may call tools, written as its template teaches
               (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of
               Qwen, Hermes and many others); calls whose name is a tool and whose arguments
               are a JSON object become `tool_calls`, the text around them the content;
  "required":  the output is held to a JSON array of one or more calls, each a tool's name
               and arguments valid for its `parameters` schema, as vLLM does;
  a function:  ({"type": "function", "function": {"name": ...}}) the output is held to
               that function's `parameters` schema: it is the call's arguments.
Held output is constrained in the decode loop (`decode.JsonSchema`), so its arguments always
parse and validate; a schema the automaton cannot enforce is a 400 naming its keyword.
`parallel_tool_calls: false` (OpenAI's: at most one call) holds "required" to one call and
keeps only the first call an "auto" answer writes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from kvjax.decode.constraints import JsonSchema, check_schema

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclasses.dataclass(frozen=True)
class Tools:
    """The request's functions (each {"name", "description", "parameters"}) and how the
    model may call them: `choice` is "none", "auto", "required" or "function" (the one
    named `function`)."""

    functions: tuple[dict, ...]
    choice: str
    function: str | None = None
    parallel: bool = True  # more than one call in an answer

    def for_template(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def constraint(self) -> JsonSchema | None:
        """What the output is held to: a call's arguments, an array of calls, or nothing."""
        if self.choice in ("none", "auto"):
            return None
        parameters = {f["name"]: f["parameters"] for f in self.functions}
        if self.choice == "function":
            return JsonSchema(parameters[self.function])
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in parameters.items()]
        return JsonSchema({"type": "array", "minItems": 1}
                          | ({} if self.parallel else {"maxItems": 1})
                          | {"items": calls[0] if len(calls) == 1 else {"anyOf": calls}})

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished answer's text: no calls when the text
        holds none, or when one it holds is not a call of a known tool."""
        if self.choice == "none":
            return text, []
        if self.choice != "auto":
            try:
                found = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: no call was made
                return text, []
            if self.choice == "function":
                found = [{"name": self.function, "arguments": found}]
            return None, [tool_call(c["name"], _json(c.get("parameters", c.get("arguments"))))
                          for c in found]
        names = {f["name"] for f in self.functions}
        found = []
        for match in _CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
            except json.JSONDecodeError:
                return text, []
            arguments = call.get("arguments", call.get("parameters")) if isinstance(
                call, dict) else None
            if call.get("name") not in names or not isinstance(arguments, dict):
                return text, []
            found.append(tool_call(call["name"], _json(arguments)))
        if not found:
            return text, []
        content = _CALL.sub("", text).strip()
        return content or None, found if self.parallel else found[:1]


def tool_call(name: str, arguments: str) -> dict:
    """One of an answer's `tool_calls`: the function's name, its arguments as JSON text."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_tools(body: dict) -> Tools | None:
    """The request's `tools` and `tool_choice`, checked; a ValueError names the bad one
    (its `name` says which field)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise _invalid("parallel_tool_calls", f"parallel_tool_calls={parallel!r} must be a "
                                              f"boolean")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _invalid("tool_choice", f"tool_choice={choice!r} needs tools")
        return None
    if not isinstance(tools, list):
        raise _invalid("tools", "tools must be a list of {'type': 'function', 'function': "
                                "{...}} objects")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(function, dict)):
            raise _invalid("tools", f"tools[{i}] must be {{'type': 'function', 'function': "
                                    f"{{'name': ..., 'parameters': {{...}}}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid("tools", f"tools[{i}].function.name={name!r} must be 1 to 64 "
                                    f"letters, digits, '_', '.' or '-'")
        if name in (f["name"] for f in functions):
            raise _invalid("tools", f"tools[{i}]: a second function named {name!r}")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _invalid("tools", f"tools[{i}].function.parameters must be a JSON Schema "
                                    f"object")
        try:
            check_schema(parameters, f"tools[{i}].function.parameters")
        except ValueError as error:
            raise _invalid("tools", str(error)) from None
        description = function.get("description")
        functions.append({"name": name, "parameters": parameters}
                         | ({} if description is None else {"description": description}))
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        name = named.get("name") if isinstance(named, dict) else None
        if name not in (f["name"] for f in functions):
            raise _invalid("tool_choice", f"tool_choice names {name!r}, which is not among "
                                          f"the tools")
        return Tools(tuple(functions), "function", name, parallel is not False)
    elif choice not in ("none", "auto", "required"):
        raise _invalid("tool_choice", f"tool_choice={choice!r} must be 'none', 'auto', "
                                      f"'required' or {{'type': 'function', 'function': "
                                      f"{{'name': ...}}}}")
    return Tools(tuple(functions), choice, parallel=parallel is not False)


def _invalid(field: str, message: str) -> ValueError:
    from kvjax.decode.checks import InvalidValue

    return InvalidValue(field, message)

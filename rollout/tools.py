"""Tools: the common special case of an environment. The model calls a tool by writing a tool call in
its turn; each call's result (or its error) comes back as a ``tool`` message; a turn without a call
ends the episode, and that turn is the answer.

The call format is Qwen's (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, JSON
between the tags), which is what Qwen2.5/Qwen3 chat templates teach; other tags are configurable
(``open_tag``/``close_tag``). The tools are described to the model by the chat template where it
renders a ``tools=`` list (as JSON schemas, in the template's own words), otherwise in a system
message of ours (the format, the tools, an example call). Tools are Python functions by import path (``tools:
["package.module:function", ...]``): keyword arguments in, text (or a number) out; an exception is
the tool's error, sent back to the model and counted. One built-in tool: ``calculator``.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
import types
import typing
from typing import Any, Callable

from rollout.environment import Environment, StepResult
from rollout.tasks import Problem
from rollout.user_code import load

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e30

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def load_tool(path: str) -> Callable:
    """A tool at ``package.module:function`` on this process's path; a clear error naming what is missing."""
    if ":" not in path:
        raise ImportError(f"rollout.environment.kwargs.tools: {path!r} is not 'package.module:function'")
    return load(path, "rollout.environment.kwargs.tools", callable, "callable")


class ToolError(ValueError):
    """A tool refused its input; the message goes back to the model."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses (e.g. "(3 + 4) * 12")."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"not an arithmetic expression: {err.msg}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def _evaluate(node: ast.AST) -> int | float:
    """Numbers and arithmetic only: a name, a call, an attribute or anything else is code and refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not abs(node.value) <= MAX_MAGNITUDE:
            raise ToolError(f"number {node.value:g} is too large (more than {MAX_MAGNITUDE:g})")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or (isinstance(value, (int, float)) and not abs(value) <= MAX_MAGNITUDE) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ToolError(f"result is too large (more than {MAX_MAGNITUDE:g}) or not a real number")
        return value
    raise ToolError(f"only numbers and + - * / // % ** are allowed, not code ({type(node).__name__})")


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_BY_NAME = {t.__name__: t for t in _JSON_TYPES}  # annotations as text (from __future__ import annotations)


def _json_type(annotation) -> str:
    """An annotation's JSON type ("int", int, Optional[int] and list[str] included; "string" when unknown)."""
    if isinstance(annotation, str):
        annotation = _BY_NAME.get(annotation.strip("\"' ").replace("Optional[", "").split("[")[0].split("|")[0].strip())
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), str)
        origin = typing.get_origin(annotation)
    return _JSON_TYPES.get(origin or annotation, "string")


def schema(fn: Callable) -> dict:
    """A tool as a chat template's ``tools=`` takes it: an OpenAI-style function schema (name, the
    docstring's first line, each parameter's JSON type; parameters without a default required)."""
    params = {name: p for name, p in inspect.signature(fn).parameters.items()
              if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    properties = {name: {"type": _json_type(p.annotation)} for name, p in params.items()}
    required = [name for name, p in params.items() if p.default is inspect.Parameter.empty]
    return {"type": "function", "function": {
        "name": fn.__name__, "description": (inspect.getdoc(fn) or "").split("\n")[0],
        "parameters": {"type": "object", "properties": properties, "required": required},
    }}


def describe(fn: Callable) -> dict:
    """A tool as the model is told of it: name, description (the docstring's first line), parameters."""
    params = {name: (p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "any"))
              for name, p in inspect.signature(fn).parameters.items()}
    return {"name": fn.__name__, "description": (inspect.getdoc(fn) or "").split("\n")[0], "parameters": params}


class ToolEnvironment(Environment):
    """Tool calls in the model's turns, answered by Python tools; the episode ends at a turn without one."""

    def __init__(self, tools: list[str] | tuple[str, ...] = ("rollout.tools:calculator",), open_tag: str = "<tool_call>",
                 close_tag: str = "</tool_call>", instructions: bool = True, max_calls_per_turn: int = 4):
        super().__init__()
        self.tools_by_name = {fn.__name__: fn for fn in (load_tool(t) for t in tools)}
        self.open_tag, self.close_tag, self.instructions = open_tag, close_tag, instructions
        self.max_calls_per_turn = max_calls_per_turn
        self._call = re.compile(re.escape(open_tag) + r"(.*?)(?:" + re.escape(close_tag) + r"|$)", re.S)

    def system_text(self) -> str:
        """What the model is told about the tools and the call format."""
        listed = "\n".join(json.dumps(describe(fn)) for fn in self.tools_by_name.values())
        example = ""
        if "calculator" in self.tools_by_name:
            call = json.dumps({"name": "calculator", "arguments": {"expression": "12 * 13"}})
            example = f"\nExample: to compute 12 times 13, write {self.open_tag}{call}{self.close_tag}"
        return (f"You can use tools. To call one, write {self.open_tag}{{\"name\": NAME, \"arguments\": {{...}}}}{self.close_tag} "
                f"and wait for its result. When you know the answer, reply without a tool call.\nTools:\n{listed}{example}")

    def tools(self) -> list[dict] | None:
        return [schema(fn) for fn in self.tools_by_name.values()] if self.instructions else None

    def reset(self, problem: Problem) -> list[dict] | None:
        if not self.instructions or self.template_tools:  # none, or the chat template describes them (tools())
            return None
        messages = problem.chat_messages()
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + self.system_text()}, *messages[1:]]
        return [{"role": "system", "content": self.system_text()}, *messages]

    def step(self, response: str) -> StepResult:
        calls = self._call.findall(response)[: self.max_calls_per_turn]
        if not calls:
            return StepResult(done=True)
        messages, errors = [], 0
        for raw in calls:
            try:
                result = self._run(raw)
            except Exception as err:  # noqa: BLE001 - the tool's error is the model's to read
                errors += 1
                result = f"error: {err}" if isinstance(err, ToolError) else f"error: {type(err).__name__}: {err}"
            messages.append({"role": "tool", "content": str(result)})
        return StepResult(messages=messages, tool_calls=len(calls), tool_errors=errors)

    def _run(self, raw: str) -> Any:
        try:
            call = json.loads(raw.strip())
        except json.JSONDecodeError as err:
            raise ToolError(f"the tool call is not JSON ({err.msg})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolError('the tool call needs {"name": ..., "arguments": {...}}')
        fn = self.tools_by_name.get(call["name"])
        if fn is None:
            raise ToolError(f"no tool named {call['name']!r}; tools: {', '.join(self.tools_by_name)}")
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise ToolError("arguments must be an object")
        return fn(**arguments)

"""The calculator task's one tool, as a tools file (`TOOLS`) for `rollout.executor_options.tools`.

Standard library only: `rl_rollout.load_tools` imports this file by path in every rollout actor.
"""

from __future__ import annotations

import ast

__all__ = ["TOOLS", "calculator"]

_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if max(abs(left), abs(right)) > 10**12:
            raise ValueError("numbers above 10^12 are not supported")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only integers, +, - and * are supported, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: for example "123 + 456".
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from error
    return str(_value(tree.body))


TOOLS = [calculator]

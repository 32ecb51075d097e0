"""How rule, reward-model and judge scores combine into one score per response.

``reward_model.combine`` is a small arithmetic expression, parsed with Python's ``ast`` and
evaluated by walking the tree: numbers, the names ``rule``, ``rm`` and ``judge``, ``+ - * /``,
unary minus and the functions ``min``, ``max``, ``abs``, ``clip(x, lo, hi)``, ``sigmoid`` and
``tanh``. Nothing else parses (no attribute access, no calls of other names, no eval of code).
The result is placed at each response's last valid token, as verl places a reward model's score.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_megatron.rollout.sampling import last_positive

__all__ = [
    "VARIABLES",
    "Formula",
    "FormulaError",
    "compile_formula",
    "default_formula",
    "place_at_last_token",
]

VARIABLES = ("rule", "rm", "judge")

_FUNCTIONS: dict[str, tuple[int, Callable[..., torch.Tensor]]] = {
    "min": (2, torch.minimum),
    "max": (2, torch.maximum),
    "abs": (1, torch.abs),
    "clip": (3, lambda x, lo, hi: torch.minimum(torch.maximum(x, lo), hi)),
    "sigmoid": (1, torch.sigmoid),
    "tanh": (1, torch.tanh),
}
_BINARY = {ast.Add: torch.add, ast.Sub: torch.sub, ast.Mult: torch.mul, ast.Div: torch.div}


class FormulaError(ValueError):
    """A combine expression that does not parse, or uses a name or construct not allowed."""


@dataclass(frozen=True)
class Formula:
    """A checked expression; ``names`` are the variables it reads."""

    text: str
    tree: ast.Expression
    names: frozenset[str]

    def __call__(self, **values: torch.Tensor) -> torch.Tensor:
        """Evaluate on [B] float tensors (one per name in ``names``); returns [B] float64."""
        missing = sorted(self.names - set(values))
        if missing:
            raise FormulaError(f"combine {self.text!r}: no value for {missing}")
        tensors = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in values.items()}
        return _evaluate(self.tree.body, tensors)


def _evaluate(node: ast.AST, values: dict[str, torch.Tensor]) -> torch.Tensor:
    if isinstance(node, ast.Constant):
        return torch.tensor(float(node.value), dtype=torch.float64)
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, ast.Call):
        _, fn = _FUNCTIONS[node.func.id]
        return fn(*(_evaluate(arg, values) for arg in node.args))
    raise FormulaError(f"unexpected node {type(node).__name__}")  # _check let it through: a bug


def _check(node: ast.AST, text: str, names: set[str]) -> None:
    """Raise FormulaError at the first construct the grammar does not allow; collect the names."""
    where = f"reward_model.combine={text!r}"
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise FormulaError(f"{where}: {node.value!r} is not a number")
    elif isinstance(node, ast.Name):
        if node.id not in VARIABLES:
            close = difflib.get_close_matches(node.id, VARIABLES, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise FormulaError(f"{where}: unknown name '{node.id}' (known: {', '.join(VARIABLES)}){hint}")
        names.add(node.id)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        _check(node.operand, text, names)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, text, names)
        _check(node.right, text, names)
    elif isinstance(node, ast.Call):
        fn = node.func.id if isinstance(node.func, ast.Name) else None
        if fn not in _FUNCTIONS:
            raise FormulaError(
                f"{where}: unknown function '{ast.unparse(node.func)}' (known: {', '.join(_FUNCTIONS)})"
            )
        arity = _FUNCTIONS[fn][0]
        if node.keywords or len(node.args) != arity:
            raise FormulaError(f"{where}: {fn}() takes {arity} positional argument(s)")
        for arg in node.args:
            _check(arg, text, names)
    else:
        raise FormulaError(
            f"{where}: '{ast.unparse(node)}' is not allowed (numbers, names, + - * /, functions)"
        )


def compile_formula(text: str) -> Formula:
    """Parse and check ``text``; raises FormulaError naming what is wrong."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise FormulaError(f"reward_model.combine={text!r} does not parse: {err.msg}") from None
    names: set[str] = set()
    _check(tree.body, text, names)
    return Formula(text, tree, frozenset(names))


def default_formula(rm_enabled: bool, judge_enabled: bool) -> str:
    """The sum of the enabled model scores (they replace the rule reward, as in verl)."""
    parts = [name for name, on in (("rm", rm_enabled), ("judge", judge_enabled)) if on]
    return " + ".join(parts) if parts else "rule"


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, Tr] float32 zeros with ``scores`` [B] at each row's last valid response token.

    The last valid token is the last column whose mask is 1: a multi-turn or agent row has
    masked environment tokens inside its response, so ``mask.sum() - 1`` could name a masked
    column. A row without response tokens gets its score at column 0 (verl's index
    ``length - 1`` would wrap to the last column)."""
    last = last_positive(response_mask).squeeze(-1).cpu()
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(out.shape[0]), last] = scores.to(torch.float32)
    return out

"""Translate the spec's guard and update registries (Python lambdas and functions over ``(v, a)``) into
Promela expressions and statements, by reading their code (``ast``) as :func:`weightsync.spec.table.
registry_digest` does.

A value is either a Python constant, known when the model is generated (a bound, ``dp_size``, the policy, an
argument the call site leaves out), or a Promela expression (a string). Operations on constants are
evaluated here (so ``bool(a.get("monotonic")) and ...`` is False when the model passes no ``monotonic``,
and the rest of the guard is not translated); the others become Promela text.

Values in Promela are ints: a bool is 0/1, an ``IntEnum`` member its value, a ``StrEnum`` member or a
string its code in :class:`Codes` (one table for every string, so an argument carrying
``WorkerState.READY.value`` equals the guard's ``"ready"``), None :data:`NONE`.
"""

from __future__ import annotations

import ast
import importlib
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any

from weightsync.spec.table import module_code

#: Promela's code of Python's None (model versions and codes are >= 0).
NONE = -1

#: A translated value: a Python constant or a Promela expression (``Expr``).
Value = Any


@dataclass(frozen=True)
class Expr:
    """A Promela expression (always parenthesised where it is combined)."""

    text: str


class TranslateError(ValueError):
    """A guard or update uses Python the translator does not handle (names the registry entry and the
    construct), or reads an argument the call site does not pass."""


@dataclass
class Codes:
    """The int code of every string and ``StrEnum`` member the generated model uses, in order of first use."""

    table: dict[str, int] = field(default_factory=dict)

    def code(self, s: str) -> int:
        """The code of string ``s`` (a new one on first use)."""
        c = self.table.get(s)
        if c is None:
            c = self.table[s] = len(self.table)
        return c

    def value(self, x: Any) -> int:
        """The Promela int of a Python constant ``x`` (bool, int, IntEnum, StrEnum, str, None).

        Raises:
            TranslateError: ``x`` has another type."""
        if x is None:
            return NONE
        if isinstance(x, bool):
            return int(x)
        if isinstance(x, IntEnum):
            return int(x.value)
        if isinstance(x, Enum):
            return self.code(str(x.value))
        if isinstance(x, int):
            return x
        if isinstance(x, str):
            return self.code(x)
        raise TranslateError(f"no Promela value for {x!r} ({type(x).__name__})")


def text(codes: Codes, x: Value) -> str:
    """``x`` as Promela text."""
    return x.text if isinstance(x, Expr) else str(codes.value(x))


_BINOPS: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Mod: ("%", operator.mod),
    ast.FloorDiv: ("/", operator.floordiv),
    ast.BitAnd: ("&", operator.and_),
    ast.BitOr: ("|", operator.or_),
}
_CMPOPS: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Eq: ("==", operator.eq),
    ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt),
    ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge),
    ast.Is: ("==", operator.is_),
    ast.IsNot: ("!=", operator.is_not),
}
#: Calls that are the identity on a Promela int (a cast, an enum built from its own code).
_IDENTITY_CALLS = frozenset({"int", "bool", "str"})


class Registry:
    """The guard and update registries of one spec module, read as code.

    Args:
        module_name: e.g. ``"weightsync.spec.rank_vars"``.
        guards: the name of its guard registry (a top-level dict literal), or None.
        updates: the name of its update registry, or None.
    """

    def __init__(self, module_name: str, guards: str | None, updates: str | None) -> None:
        self.module = importlib.import_module(module_name)
        self.functions, literals = module_code(module_name)
        self.entries: dict[str, dict[str, ast.expr]] = {}
        for kind, name in (("guard", guards), ("update", updates)):
            if name is None:
                self.entries[kind] = {}
                continue
            d = literals.get(name)
            if not isinstance(d, ast.Dict):
                raise TranslateError(f"{module_name}.{name} is not a dict literal at the top level")
            self.entries[kind] = {
                k.value: v
                for k, v in zip(d.keys, d.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            }


class Translator:
    """Translates one component's guards and updates.

    Args:
        registry: the component's :class:`Registry`.
        codes: the string codes shared by the whole generated model.
        var: Promela lvalue of a variable field (``"current_wave"`` -> ``"r_cw[i]"``).
        fields: the variables' field names (``v._replace`` may name only these).
    """

    def __init__(
        self, registry: Registry, codes: Codes, var: Callable[[str], str], fields: Sequence[str]
    ) -> None:
        self.registry = registry
        self.codes = codes
        self.var = var
        self.fields = tuple(fields)

    # ------------------------------------------------------------------ entry points

    def guard(self, name: str, args: Mapping[str, Value]) -> Value:
        """Guard ``name`` as a Promela boolean (or a constant) given the event's ``args``.

        Raises:
            TranslateError: an unknown guard, an unhandled construct, or an argument ``args`` lacks."""
        node = self.registry.entries["guard"].get(name)
        if node is None:
            raise TranslateError(f"guard {name!r} is not in {self.registry.module.__name__}'s registry")
        return self._call_value(node, args, f"guard {name!r}")

    def update(self, name: str, args: Mapping[str, Value]) -> list[tuple[Value, dict[str, Value]]]:
        """Update ``name`` as guarded assignments: ``[(condition, {field: value})]``, the first whose
        condition holds applies (the last has condition True); every value reads the variables *before*
        the update.

        Raises:
            TranslateError: as :meth:`guard`, or a ``_replace`` of an unknown field."""
        node = self.registry.entries["update"].get(name)
        if node is None:
            raise TranslateError(f"update {name!r} is not in {self.registry.module.__name__}'s registry")
        where = f"update {name!r}"
        body, env = self._body(node, args, where)
        return self._cases(body, env, where)

    # ------------------------------------------------------------------ helpers

    def _body(self, node: ast.expr, args: Mapping[str, Value], where: str) -> tuple[ast.expr, dict[str, Any]]:
        """The returned expression of a registry value (a lambda, or a module function's single return
        after simple local assignments) and its environment."""
        env: dict[str, Any] = {}
        if isinstance(node, ast.Lambda):
            params = [p.arg for p in node.args.args]
            env.update(zip(params, ("v", ("a", args)), strict=False))
            return node.body, env
        if isinstance(node, ast.Name) and node.id in self.registry.functions:
            fn = self.registry.functions[node.id]
            params = [p.arg for p in fn.args.args]
            env.update(zip(params, ("v", ("a", args)), strict=False))
            return self._function_return(fn, env, where)
        raise TranslateError(f"{where}: not a lambda or a module function: {ast.unparse(node)}")

    def _function_return(
        self, fn: ast.FunctionDef, env: dict[str, Any], where: str
    ) -> tuple[ast.expr, dict[str, Any]]:
        """The value a module function returns, as one expression: its docstring skipped, simple local
        assignments bound in ``env``, and ``if c: return x`` statements before the last ``return y``
        folded into ``x if c else y``."""
        early: list[tuple[ast.expr, ast.expr]] = []
        for stmt in fn.body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # docstring
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                env[stmt.targets[0].id] = self.value(stmt.value, env, where)
                continue
            if (
                isinstance(stmt, ast.If)
                and not stmt.orelse
                and len(stmt.body) == 1
                and isinstance(stmt.body[0], ast.Return)
                and stmt.body[0].value is not None
            ):
                early.append((stmt.test, stmt.body[0].value))
                continue
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                out: ast.expr = stmt.value
                for test, value in reversed(early):
                    out = ast.IfExp(test=test, body=value, orelse=out)
                return out, env
            raise TranslateError(
                f"{where}: {fn.name} has a statement the translator does not handle: {ast.unparse(stmt)}"
            )
        raise TranslateError(f"{where}: {fn.name} has no return")

    def call(self, name: str, *values: Value) -> Value:
        """Module function ``name`` applied to ``values`` (Promela expressions or constants).

        Raises:
            TranslateError: as :meth:`guard`."""
        fn = self.registry.functions.get(name)
        if fn is None:
            raise TranslateError(f"{name!r} is not a function of {self.registry.module.__name__}")
        env = dict(zip([p.arg for p in fn.args.args], values, strict=True))
        body, env = self._function_return(fn, env, name)
        return self.value(body, env, name)

    def _call_value(self, node: ast.expr, args: Mapping[str, Value], where: str) -> Value:
        body, env = self._body(node, args, where)
        return self.value(body, env, where)

    def _cases(self, body: ast.expr, env: dict[str, Any], where: str) -> list[tuple[Value, dict[str, Value]]]:
        if isinstance(body, ast.IfExp):
            cond = self.value(body.test, env, where)
            if not isinstance(cond, Expr):
                return self._cases(body.body if cond else body.orelse, env, where)
            then = self._cases(body.body, env, where)
            return [(and_(cond, c), a) for c, a in then] + self._cases(body.orelse, env, where)
        if isinstance(body, ast.Name) and env.get(body.id) == "v":
            return [(True, {})]
        if (
            isinstance(body, ast.Call)
            and isinstance(body.func, ast.Attribute)
            and body.func.attr == "_replace"
            and isinstance(body.func.value, ast.Name)
            and env.get(body.func.value.id) == "v"
        ):
            out: dict[str, Value] = {}
            for kw in body.keywords:
                if kw.arg not in self.fields:
                    raise TranslateError(f"{where}: _replace of unknown field {kw.arg!r}")
                out[kw.arg] = self.value(kw.value, env, where)
            return [(True, out)]
        raise TranslateError(
            f"{where}: an update must return v, v._replace(...) or a conditional of them: {ast.unparse(body)}"
        )

    # ------------------------------------------------------------------ expressions

    def value(self, node: ast.expr, env: Mapping[str, Any], where: str) -> Value:
        """The value of expression ``node`` under ``env`` (names bound to "v", ("a", args) or values)."""
        codes = self.codes
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if hasattr(self.registry.module, node.id):
                return getattr(self.registry.module, node.id)
            raise TranslateError(f"{where}: unknown name {node.id!r}")
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and env.get(node.value.id) == "v":
                if node.attr not in self.fields:
                    raise TranslateError(f"{where}: unknown variable {node.attr!r}")
                return Expr(self.var(node.attr))
            base = self.value(node.value, env, where)
            if isinstance(base, Expr):
                raise TranslateError(f"{where}: attribute of a Promela value: {ast.unparse(node)}")
            return getattr(base, node.attr)
        if isinstance(node, ast.BoolOp):
            is_and = isinstance(node.op, ast.And)
            parts: list[Value] = []
            for operand in node.values:
                x = self.value(operand, env, where)
                if not isinstance(x, Expr):
                    if bool(x) != is_and:  # False in an and, True in an or: decided (no side effects)
                        return bool(x)
                    continue
                parts.append(x)
            if not parts:
                return is_and
            return Expr("(" + (" && " if is_and else " || ").join(text(codes, p) for p in parts) + ")")
        if isinstance(node, ast.UnaryOp):
            x = self.value(node.operand, env, where)
            if isinstance(node.op, ast.Not):
                return Expr(f"(!{x.text})") if isinstance(x, Expr) else not x
            if isinstance(node.op, ast.USub):
                return Expr(f"(-{x.text})") if isinstance(x, Expr) else -x
            if isinstance(node.op, ast.Invert):
                return Expr(f"(~{x.text})") if isinstance(x, Expr) else ~x
            raise TranslateError(f"{where}: unary {ast.unparse(node)}")
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise TranslateError(f"{where}: operator in {ast.unparse(node)}")
            left, right = self.value(node.left, env, where), self.value(node.right, env, where)
            if not isinstance(left, Expr) and not isinstance(right, Expr):
                return op[1](left, right)
            return Expr(f"({text(codes, left)} {op[0]} {text(codes, right)})")
        if isinstance(node, ast.Compare):
            terms: list[Value] = []
            left = self.value(node.left, env, where)
            for cop, comp in zip(node.ops, node.comparators, strict=True):
                right = self.value(comp, env, where)
                o = _CMPOPS.get(type(cop))
                if o is None:
                    raise TranslateError(f"{where}: comparison in {ast.unparse(node)}")
                if not isinstance(left, Expr) and not isinstance(right, Expr):
                    if not o[1](left, right):
                        return False
                else:
                    terms.append(Expr(f"({text(codes, left)} {o[0]} {text(codes, right)})"))
                left = right
            if not terms:
                return True
            return terms[0] if len(terms) == 1 else Expr("(" + " && ".join(t.text for t in terms) + ")")
        if isinstance(node, ast.IfExp):
            cond = self.value(node.test, env, where)
            if not isinstance(cond, Expr):
                return self.value(node.body if cond else node.orelse, env, where)
            a, b = self.value(node.body, env, where), self.value(node.orelse, env, where)
            return Expr(f"({cond.text} -> {text(codes, a)} : {text(codes, b)})")
        if isinstance(node, ast.Subscript):
            base = self.value(node.value, env, where)
            key = self.value(node.slice, env, where)
            if isinstance(base, tuple) and base[0] == "a":
                return self._arg(base[1], key, where, required=True)
            if isinstance(base, Mapping):
                if not isinstance(key, Expr):
                    return base[key]
                # a lookup in a constant dict by a Promela value: a chain of conditional expressions
                items = list(base.items())
                out = text(codes, items[-1][1])
                for k, val in reversed(items[:-1]):
                    out = f"(({key.text} == {codes.value(k)}) -> {text(codes, val)} : {out})"
                return Expr(out)
            raise TranslateError(f"{where}: subscript {ast.unparse(node)}")
        if isinstance(node, ast.Call):
            return self._call(node, env, where)
        raise TranslateError(f"{where}: construct {type(node).__name__}: {ast.unparse(node)}")

    def _arg(
        self, args: Mapping[str, Value], key: Value, where: str, required: bool, default: Value = None
    ) -> Value:
        if isinstance(key, Expr):
            raise TranslateError(f"{where}: an argument named by a Promela value")
        if key in args:
            return args[key]
        if required:
            raise TranslateError(f"{where}: reads argument {key!r}, which the call site does not pass")
        return default

    def _call(self, node: ast.Call, env: Mapping[str, Any], where: str) -> Value:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and isinstance(func.value, ast.Name):
            base = env.get(func.value.id)
            if isinstance(base, tuple) and base[0] == "a":
                key = self.value(node.args[0], env, where)
                default = self.value(node.args[1], env, where) if len(node.args) > 1 else None
                return self._arg(base[1], key, where, required=False, default=default)
        if isinstance(func, ast.Name):
            name = func.id
            if not node.args and isinstance(env.get(name), Expr):  # a bound thunk: its value
                return env[name]
            if name in _IDENTITY_CALLS and name not in env:
                x = self.value(node.args[0], env, where)
                if isinstance(x, Expr):
                    return Expr(f"({x.text} != 0)") if name == "bool" else x
                return {"bool": bool, "int": int, "str": str}[name](x)
            if name in self.registry.functions:
                fn = self.registry.functions[name]
                params = [p.arg for p in fn.args.args]
                values = [self.value(a, env, where) for a in node.args]
                inner = dict(zip(params, values, strict=True))
                body, inner_env = self._function_return(fn, inner, f"{where} -> {name}")
                return self.value(body, inner_env, f"{where} -> {name}")
            target = self.value(func, env, where)
            if isinstance(target, type) and issubclass(target, Enum) and len(node.args) == 1:
                x = self.value(node.args[0], env, where)
                return x if isinstance(x, Expr) else target(x)
        raise TranslateError(f"{where}: call {ast.unparse(node)}")


def not_(x: Value) -> Value:
    """Promela ``!x`` (folded when ``x`` is a constant)."""
    return Expr(f"(!{x.text})") if isinstance(x, Expr) else not x


def and_(a: Value, b: Value) -> Value:
    """Promela ``a && b`` (folded where either is a constant)."""
    if not isinstance(a, Expr):
        return b if a else False
    if not isinstance(b, Expr):
        return a if b else False
    return Expr(f"({a.text} && {b.text})")


def or_(a: Value, b: Value) -> Value:
    """Promela ``a || b`` (folded where either is a constant)."""
    if not isinstance(a, Expr):
        return True if a else b
    if not isinstance(b, Expr):
        return True if b else a
    return Expr(f"({a.text} || {b.text})")


def ite(c: Value, a: Value, b: Value) -> Value:
    """``a`` if ``c`` else ``b``, as a Promela boolean (folded where ``c`` is a constant)."""
    if not isinstance(c, Expr):
        return a if c else b
    return or_(and_(c, a), and_(not_(c), b))

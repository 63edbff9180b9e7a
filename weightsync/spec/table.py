"""Generic plain-data transition tables and a sans-IO machine that runs them.

A table maps ``(state, event)`` to an ordered tuple of :class:`Transition` alternatives. Each alternative
has a named guard (a predicate over the machine's local variables and the event's arguments), a target
state, a tuple of named *updates* (pure changes to local variables, applied by the machine itself) and a
tuple of named *effects* (what the runtime must do: enter a collective, send a message, reply to a call).
The first alternative whose guard holds fires. A ``(state, event)`` pair missing from the table, or one
whose guards all fail, is illegal: the machine raises ``LocalProtocolError`` (local calls) or
``RemoteProtocolError`` (peer messages, collective outcomes) and moves to its sticky ``error`` state.

This mirrors h11's ``_state.py``: everything that affects transitions lives in data, and diagrams and
documentation are generated from it.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, Generic, NamedTuple, TypeVar

from weightsync.spec.errors import LocalProtocolError, RemoteProtocolError

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)
V = TypeVar("V")  # the local-variables record (a NamedTuple)

#: A guard reads the local variables and the event's arguments and answers whether a transition may fire.
Guard = Callable[[Any, Mapping[str, Any]], bool]
#: An update returns the new local variables; it never does I/O.
Update = Callable[[Any, Mapping[str, Any]], Any]

ALWAYS = "always"


class Transition(NamedTuple):
    """One row of a transition table.

    Attributes:
        guard: name of a predicate in the table's guard registry (``"always"`` fires unconditionally).
        target: the state after the transition.
        updates: names of pure local-variable updates applied in order by the machine.
        effects: names of effects the runtime executes (the model interprets them symbolically).
        rule: where the rule comes from (a vLLM PR or issue, a section of the reference, or "weightsync").
    """

    guard: str
    target: Any
    updates: tuple[str, ...]
    effects: tuple[str, ...]
    rule: str


class Fired(NamedTuple):
    """The result of firing an event: the transition taken and the variables before and after."""

    source: Any
    event: Any
    transition: Transition
    before: Any
    after: Any


def select_transition(
    table: Mapping[tuple[Any, Any], tuple[Transition, ...]],
    state: Any,
    event: Any,
    variables: Any,
    args: Mapping[str, Any],
    guards: Mapping[str, Guard],
) -> Transition | None:
    """The row ``event`` takes from ``state`` (the first whose guard holds), or None when it is illegal.
    Pure: the one row-selection rule every machine, model and checker uses."""
    for tr in table.get((state, event), ()):
        if tr.guard == ALWAYS or guards[tr.guard](variables, args):
            return tr
    return None


def enabled_transitions(
    table: Mapping[tuple[Any, Any], tuple[Transition, ...]],
    state: Any,
    event: Any,
    variables: Any,
    args: Mapping[str, Any],
    guards: Mapping[str, Guard],
) -> list[Transition]:
    """Every row ``event`` may take from ``state`` (each whose guard holds, in table order): the choices of
    a nondeterministic user of a table (the model's controller). Pure."""
    return [
        tr for tr in table.get((state, event), ()) if tr.guard == ALWAYS or guards[tr.guard](variables, args)
    ]


def apply_transition(
    variables: V, tr: Transition, args: Mapping[str, Any], updates: Mapping[str, Update]
) -> V:
    """``variables`` after ``tr``'s updates (in order) and its move to ``tr.target``. Pure."""
    v: Any = variables
    for name in tr.updates:
        v = updates[name](v, args)
    out: V = v._replace(state=tr.target)
    return out


def table_digest(rows: Iterable[tuple[Any, Any, Transition]], *extra: str) -> str:
    """A stable SHA-256 hex digest of table rows (state, event, transition), used by ``prove --check``."""
    h = hashlib.sha256()
    for state, event, tr in rows:
        target = tr.target.value if isinstance(tr.target, Enum) else str(tr.target)
        line = "|".join(
            [
                state.value if isinstance(state, Enum) else str(state),
                event.value if isinstance(event, Enum) else str(event),
                tr.guard,
                target,
                ",".join(tr.updates),
                ",".join(tr.effects),
            ]
        )
        h.update(line.encode())
        h.update(b"\n")
    for e in extra:
        h.update(e.encode())
        h.update(b"\n")
    return h.hexdigest()


@functools.cache
def module_code(module_name: str) -> tuple[dict[str, ast.FunctionDef], dict[str, ast.expr]]:
    """The parsed code of a module's top level: its functions by name, and the value of each name assigned
    at the top level (``x = ...`` or ``x: T = ...``). :func:`registry_digest` hashes registries from it;
    the Promela generator (:mod:`weightsync.model.spin.translate`) translates them from it."""
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    literals: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            literals.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            literals[node.target.id] = node.value
    return functions, literals


def registry_digest(module_name: str, *registries: str) -> str:
    """A SHA-256 hex digest of the code behind named guard / update registries of one module: each entry's
    name and its value's source, and the source of every function of that module the values call, directly
    or through each other (docstrings, comments and layout left out: the text is ``ast.unparse`` of the
    parsed code). A table's digest names its guards and updates; this one covers what they compute, so
    changing a guard's body makes ``weightsync prove --check`` report the proofs stale.

    Covered: the registry dict literals and the module's own functions. Not covered: what those functions
    import from other modules (an enum's members, a constant of ``weightsync.spec.states``).

    Args:
        module_name: the module defining the registries, e.g. ``"weightsync.spec.rank_vars"``.
        registries: names of module-level dict literals, e.g. ``"GUARDS", "UPDATES"``.

    Raises:
        ValueError: a name is not assigned a dict literal at the module's top level.
    """
    functions, literals = module_code(module_name)
    h = hashlib.sha256()
    called: set[str] = set()

    def calls(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in functions}

    for name in registries:
        value = literals.get(name)
        if not isinstance(value, ast.Dict):
            raise ValueError(f"registry_digest: {module_name}.{name} is not a dict literal at the top level")
        h.update(f"\n{name}\n{ast.unparse(value)}".encode())
        called |= calls(value)
    done: set[str] = set()
    while called - done:
        fn = min(called - done)
        done.add(fn)
        node = copy.deepcopy(functions[fn])
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            node.body = body[1:] or [ast.Pass()]  # the docstring
        h.update(f"\n{ast.unparse(node)}".encode())
        called |= calls(node)
    return h.hexdigest()


class TableMachine(Generic[S, E]):
    """A sans-IO state machine interpreting a plain-data table.

    Args:
        name: shown in error messages (e.g. ``"rank 1"``).
        table: ``{(state, event): (Transition, ...)}``.
        guards: guard registry, name -> predicate.
        updates: update registry, name -> pure function.
        variables: the initial local variables; must have a ``state`` field.
        local_events: events that are local calls (errors on them are LocalProtocolError).
        error_state: the sticky error state.

    Raises:
        LocalProtocolError / RemoteProtocolError from :meth:`fire` as described in the module docstring.
    """

    def __init__(
        self,
        name: str,
        table: Mapping[tuple[S, E], tuple[Transition, ...]],
        guards: Mapping[str, Guard],
        updates: Mapping[str, Update],
        variables: Any,
        local_events: frozenset[E],
        error_state: S,
    ) -> None:
        self.name = name
        self._table = table
        self._guards = guards
        self._updates = updates
        self.vars: Any = variables
        self._local_events = local_events
        self._error_state = error_state

    @property
    def state(self) -> S:
        """The current state."""
        s: S = self.vars.state
        return s

    def legal_events(self) -> list[E]:
        """Events with at least one row in the current state (guards not evaluated), sorted by value."""
        return sorted({e for (s, e) in self._table if s == self.state}, key=lambda e: str(e.value))

    def select(self, event: E, args: Mapping[str, Any]) -> Transition | None:
        """The transition ``event`` would take now, or None if it is illegal. Changes nothing."""
        return select_transition(self._table, self.state, event, self.vars, args, self._guards)

    def fire(self, event: E, **args: Any) -> Fired:
        """Apply ``event`` with its arguments; return what fired (its effects are for the caller to run).

        Raises:
            LocalProtocolError: ``event`` is a local call with no legal transition in this state.
            RemoteProtocolError: ``event`` is a message or collective outcome with no legal transition.
            In both cases the machine moves to the sticky error state and no update is applied.
        """
        before = self.vars
        tr = self.select(event, args)
        if tr is None:
            self._fail(event, args)
        assert tr is not None
        v = apply_transition(before, tr, args, self._updates)
        self.vars = v
        return Fired(before.state, event, tr, before, v)

    def explain_illegal(self, event: E, args: Mapping[str, Any]) -> str:
        """Why ``event`` is illegal now: the state, the event with its arguments, the guards that failed and
        the legal events (the text of the error :meth:`fire` would raise). Changes nothing."""
        state = self.state
        rows = self._table.get((state, event), ())
        legal = ", ".join(str(e.value) for e in self.legal_events()) or "none"
        if rows:
            why = "guard(s) " + " / ".join(tr.guard for tr in rows) + " do not hold"
        else:
            why = "no transition for this event in this state"
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(args.items()))
        return (
            f"{self.name}: event {getattr(event, 'value', event)}({shown}) is illegal in state "
            f"{getattr(state, 'value', state)}: {why}; legal events here: {legal}"
        )

    def _fail(self, event: E, args: Mapping[str, Any]) -> None:
        msg = self.explain_illegal(event, args)
        self.vars = self.vars._replace(state=self._error_state)
        if event in self._local_events:
            raise LocalProtocolError(msg)
        raise RemoteProtocolError(msg)

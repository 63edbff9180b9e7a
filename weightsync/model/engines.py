"""The exploration engines: :func:`explore_model` explores a :class:`~weightsync.model.system.Model` with its
safety checks, by the compact engine (:mod:`weightsync.model.compact`) or the baseline one (the model's
successor function on :class:`~weightsync.model.system.GlobalState` values, :func:`weightsync.model.explorer.explore`)."""

from __future__ import annotations

from weightsync.model.compact import explore_compact
from weightsync.model.explorer import Exploration, explore
from weightsync.model.system import G, Model

#: The exploration engines (:func:`explore_model`): the compact one is the default.
ENGINES = ("compact", "baseline")
DEFAULT_ENGINE = "compact"


def explore_model(
    model: Model,
    *,
    symmetry: bool = False,
    keep_edges: bool = False,
    keep_labels: bool = False,
    max_states: int = 50_000_000,
    stop_at_first: bool = False,
    engine: str = DEFAULT_ENGINE,
    deadline: float | None = None,
) -> Exploration[G]:
    """:func:`~weightsync.model.explorer.explore` of ``model`` from its initial state with its safety checks
    (invariant, edge and terminal checks), up to rank permutations when ``symmetry``.

    ``engine``: ``"compact"`` (:mod:`weightsync.model.compact`: encoded states, memoised transitions) or
    ``"baseline"`` (the model's successor function on :class:`GlobalState` values); both give the same
    exploration (states in the same order, counts, violations, paths). ``deadline``: stop once
    ``time.time()`` passes it (:func:`~weightsync.model.explorer.explore`).

    Raises:
        ValueError: an unknown ``engine``."""
    if engine == "compact":
        return explore_compact(
            model,
            symmetry=symmetry,
            keep_edges=keep_edges,
            keep_labels=keep_labels,
            max_states=max_states,
            stop_at_first=stop_at_first,
            deadline=deadline,
        )[0]
    if engine != "baseline":
        raise ValueError(f"engine={engine!r}: known engines are {', '.join(ENGINES)}")
    return explore(
        [model.initial()],
        model.successors,
        invariant=model.invariant,
        edge_check=model.edge_check,
        terminal_check=model.terminal_check,
        canon=model.canon if symmetry else None,
        keep_edges=keep_edges,
        keep_labels=keep_labels,
        max_states=max_states,
        stop_at_first=stop_at_first,
        deadline=deadline,
    )

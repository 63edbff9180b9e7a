"""The model checker: the N-rank product of the spec's tables, an exhaustive explorer and named properties.

Public API (for ``export``, ``prove``, ``replay``):

- :func:`~weightsync.model.check.build_model` (variant, N, mode, channels, bounds) -> :class:`Model`;
- :func:`~weightsync.model.check.check` -> the ``weightsync check`` JSON object;
  :func:`~weightsync.model.check.check_mode` for one mode (keeps the model and exploration with ``keep``);
- :func:`~weightsync.model.explorer.explore` (generic BFS) and :class:`~weightsync.model.explorer.Exploration`;
- :meth:`Model.successors` (labelled edges), :func:`~weightsync.model.system.steps.describe` (edge ->
  :class:`Step`), :func:`~weightsync.model.check.step_edge` / :func:`~weightsync.model.check.replay_labels`
  (trace validation);
- :func:`~weightsync.model.export.counterexample_mermaid`, :func:`~weightsync.model.export.state_graph`
  (networkx DiGraph, GraphML-safe);
- :data:`~weightsync.model.check.PROPERTIES` (name -> statement, source).
"""

from weightsync.model.check import build_model, check, check_mode, counterexample_record
from weightsync.model.explorer import Exploration, explore
from weightsync.model.export import counterexample_mermaid, state_graph
from weightsync.model.labels import replay_labels, step_edge
from weightsync.model.properties import PROPERTIES
from weightsync.model.system import Bounds, Config, Model, Step, describe

__all__ = [
    "PROPERTIES",
    "Bounds",
    "Config",
    "Exploration",
    "Model",
    "Step",
    "build_model",
    "check",
    "check_mode",
    "counterexample_mermaid",
    "counterexample_record",
    "describe",
    "explore",
    "replay_labels",
    "state_graph",
    "step_edge",
]

"""SPIN on the protocol: Promela generated from the ``weightsync/spec`` tables, checked by SPIN, its verdict
checked by the model (issue 19, item 4).

- :mod:`~weightsync.model.spin.translate` reads the spec's guard and update registries as code (``ast``) and
  writes them as Promela expressions and assignments; constants of the configuration fold away.
- :mod:`~weightsync.model.spin.tables` writes a table's row selection (first guard that holds; none: illegal).
- :mod:`~weightsync.model.spin.build`, :mod:`~weightsync.model.spin.ranks`, :mod:`~weightsync.model.spin.ctrl`,
  :mod:`~weightsync.model.spin.moves` and :mod:`~weightsync.model.spin.props` compose them as
  :mod:`weightsync.model.system` does: one Promela move per model move (same label, same change), the
  invariants in a monitor process, the edge checks at the end of each move, the terminal check as the
  moves' ``else``.
- :mod:`~weightsync.model.spin.compose` is the whole model (:class:`PromelaModel`);
  :mod:`~weightsync.model.spin.run` compiles and runs it and replays SPIN's trail on
  :meth:`~weightsync.model.system.Model.successors`; :mod:`~weightsync.model.spin.mode` is one pause mode of
  ``weightsync check --engine spin``.

Nothing here is written by hand per variant: a table edit changes the generated model. The state encoding
is one-to-one, so with the checks off SPIN stores exactly the model's states (``tests/test_spin.py``).
"""

"""weightsync: a formally checked protocol for moving weights from an RL trainer into LLM inference engines.

Three layers share one transition table:

- :mod:`weightsync.spec`  -- the protocol as plain data plus a sans-IO ``RankMachine``;
- :mod:`weightsync.model` -- the N-rank product explored exhaustively (model checking);
- :mod:`weightsync.impl`  -- the same table driving real torch.distributed processes.
"""

__version__ = "0.1.0"

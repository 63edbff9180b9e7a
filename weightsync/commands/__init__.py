"""The handlers of the ``weightsync`` commands, one module per subsystem.

:mod:`weightsync.cli` parses the arguments and dispatches here; each handler takes the parsed arguments,
calls into :mod:`weightsync.model`, :mod:`weightsync.impl`, :mod:`weightsync.demo`, :mod:`weightsync.bench`
or (imported only when the command runs) :mod:`weightsync.vllm`, prints, and returns the exit code. Like
the CLI, this is where the model and the implementation may meet.

- :mod:`weightsync.commands.model`: ``variants``, ``check``, ``export``, ``prove``, ``mutate``;
- :mod:`weightsync.commands.bench`: ``bench``;
- :mod:`weightsync.commands.demo`: ``demo``;
- :mod:`weightsync.commands.repro`: ``repro``, ``record``;
- :mod:`weightsync.commands.replay`: ``replay``;
- :mod:`weightsync.commands.common`: exit codes, ``--json`` output, progress lines, the lazy vLLM import.
"""

"""``python -m weightsync.cli``: the ``weightsync`` command."""

from weightsync.cli import main

raise SystemExit(main())

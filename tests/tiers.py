"""The test tiers (``pyproject.toml`` markers): ``CI_ONLY`` marks a slow run that ``.ci/run`` still runs, once,
after the default suite (``make test-slow-ci``); the default suite (``make test``) leaves it out."""

from __future__ import annotations

import pytest

CI_ONLY = (pytest.mark.slow, pytest.mark.ci)

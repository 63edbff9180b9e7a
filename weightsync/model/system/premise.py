"""The error a reduction raises when the table in use breaks a premise it relies on."""

from __future__ import annotations


class ReductionPremiseError(RuntimeError):
    """A state-space reduction met a table that breaks its premise (the message names the rank, the row and
    the rule); the exploration stops, since its verdict would not be sound. Check without the reduction."""

"""Sequence-level expert activation tracing: EAMs, the EAMC, online adaptation, router tracing.

numpy-only here; `moeinf.trace.router` and `moeinf.trace.collect` (which need torch and transformers)
are imported explicitly by those who trace a model.
"""

from __future__ import annotations

from .eam import accuracy, distance, flat_unit_rows, normalize_rows, similarity, sum_normalize_rows
from .eamc import EAMC, EAMCMismatchError
from .matcher import Matcher
from .online import OnlineEAMC
from .rawtrace import RawTrace, load_step_counts, read_raw, write_raw

__all__ = [
    "EAMC", "EAMCMismatchError", "Matcher", "OnlineEAMC", "RawTrace", "accuracy", "distance",
    "flat_unit_rows", "load_step_counts", "normalize_rows", "read_raw", "similarity", "sum_normalize_rows",
    "write_raw",
]

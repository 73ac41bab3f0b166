"""The aligned expert store: `pack` a HuggingFace checkpoint, open it as a `Store`, `verify` it.

Layout and index format: docs/internals.md, "Store".
"""

from __future__ import annotations

from .index import ExpertEntry, StoreError, StoreIndex, TensorEntry
from .pack import pack
from .reader import Store
from .verify import Problem, unchecked, verify

__all__ = ["pack", "Store", "verify", "unchecked", "Problem", "StoreIndex", "ExpertEntry", "TensorEntry",
           "StoreError"]

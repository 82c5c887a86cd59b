"""The search log: every evaluated mask as one JSON line, written as it happens so a stopped search keeps its record."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

LOG_FILENAME = "search_log.jsonl"


def to_json_safe(value: Any) -> Any:
    """``value`` with numpy/torch scalars and arrays, tuples and paths turned into JSON types."""
    if isinstance(value, Mapping):
        return {str(key): to_json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [to_json_safe(item) for item in value]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return to_json_safe(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


class SearchLog:
    """Every evaluated mask, in memory and (if ``path``) appended to ``search_log.jsonl`` as it happens."""

    def __init__(self, path: Path | None):
        self.path = path
        self.rows: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        row = to_json_safe(row)
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")

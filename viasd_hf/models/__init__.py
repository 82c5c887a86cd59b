"""Models as viasd_hf loads and measures them: loading, the offline zoo, quantisation, this machine, pass costs.

``from viasd_hf.models import load_pretrained`` is resolved on first use: the engine imports
``viasd_hf.models.machine`` and friends, and loading everything here would make that a cycle.
"""

from typing import Any

__all__ = ["load_pretrained"]


def __getattr__(name: str) -> Any:
    if name == "load_pretrained":
        from viasd_hf.models.loading import load_pretrained

        return load_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

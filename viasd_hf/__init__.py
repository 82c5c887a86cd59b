"""viasd_hf: VIA-SD speculative decoding (drafter → slim verifier → full target) for Hugging Face models."""

__version__ = "0.1.0"

from .architectures import UnsupportedArchitectureError  # noqa: E402
from .masks import RoutingMask, RoutingMaskError  # noqa: E402
from .routing import routed  # noqa: E402

__all__ = ["RoutingMask", "RoutingMaskError", "UnsupportedArchitectureError", "routed", "__version__"]

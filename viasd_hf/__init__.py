"""viasd_hf: VIA-SD speculative decoding (drafter → slim verifier → full target) for Hugging Face models."""

__version__ = "0.1.0"

from .architectures import UnsupportedArchitectureError  # noqa: E402
from .masks import RoutingMask, RoutingMaskError  # noqa: E402
from .routing import routed  # noqa: E402
from .config import ViaSDConfig  # noqa: E402
from .generation import ViaSDGenerationMixin, disable_viasd, enable_viasd, viasd_generate  # noqa: E402
from .stats import ViaSDStats  # noqa: E402

__all__ = [
    "RoutingMask",
    "RoutingMaskError",
    "UnsupportedArchitectureError",
    "ViaSDConfig",
    "ViaSDGenerationMixin",
    "ViaSDStats",
    "disable_viasd",
    "enable_viasd",
    "routed",
    "viasd_generate",
    "__version__",
]

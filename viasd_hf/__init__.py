"""viasd_hf: VIA-SD speculative decoding (drafter → slim verifier → full target) for Hugging Face models."""

from .architectures import UnsupportedArchitectureError
from .config import ViaSDConfig
from .generation import ViaSDGenerationMixin, disable_viasd, enable_viasd, viasd_generate
from .mask_set import MaskSet
from .masks import RoutingMask, RoutingMaskError
from .routing import routed
from .stats import ViaSDStats
from .version import __version__

__all__ = [
    "MaskSet",
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

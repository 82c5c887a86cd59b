"""viasd_hf: VIA-SD speculative decoding (drafter → slim verifier → full target) for Hugging Face models."""

from viasd_hf.extras import quietly as _quietly

# transformers' models import torchao where it is installed, and torchao logs its kernels as they load
with _quietly():
    from viasd_hf.config import PaperKnobs, ViaSDConfig
    from viasd_hf.engine.stats import ViaSDStats
    from viasd_hf.generation import ViaSDGenerationMixin, disable_viasd, enable_viasd, viasd_generate
    from viasd_hf.masks.architectures import UnsupportedArchitectureError
    from viasd_hf.masks.layer_skipping import routed
    from viasd_hf.masks.mask_set import MaskSet
    from viasd_hf.masks.routing_mask import RoutingMask, RoutingMaskError
    from viasd_hf.version import __version__

__all__ = [
    "MaskSet",
    "PaperKnobs",
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

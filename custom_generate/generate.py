"""VIA-SD for ``model.generate(custom_generate="<this repo or folder>", trust_remote_code=True, ...)``.

transformers loads this file and calls ``generate(model=..., **generate_arguments)``. It hands the
call to viasd_hf, which rewrites the arguments the same way ``enable_viasd`` does and runs
``viasd_generate`` after transformers' usual preparation: the two paths give the same output.
"""

from transformers import GenerationMixin

from viasd_hf import ViaSDConfig
from viasd_hf.generation import viasd_generate_kwargs


def generate(model, viasd_config=None, **kwargs):
    """``viasd_config`` as in ``enable_viasd``; everything else as in ``model.generate``."""
    return GenerationMixin.generate(model, **viasd_generate_kwargs(ViaSDConfig() if viasd_config is None else viasd_config, kwargs))

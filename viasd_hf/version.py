"""The version of viasd_hf, in a module of its own so that modules inside the package need not import the package."""

__version__ = "0.1.0"

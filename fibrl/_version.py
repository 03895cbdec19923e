"""fibrl's version: one place, below every layer (setup.cfg, the image tags and the
kubernetes backend's default pod image read it)."""
__version__ = "0.1.0"

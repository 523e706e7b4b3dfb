"""lorad: a serving daemon for one base language model plus many LoRA adapters."""

__version__ = "0.1.0"

"""quantkit: quantize Hugging Face causal LMs for every major runtime."""
__version__ = "0.1.0"

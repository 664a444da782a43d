"""FSDP fine-tuning recipes for Hugging Face models: the shared machinery the recipes in `recipes/` use."""

__version__ = "0.1.0"

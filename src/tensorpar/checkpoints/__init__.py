"""Checkpoints: tensorpar's sharded checkpoints (save, load, reshard to any layout) and Hugging Face folders."""

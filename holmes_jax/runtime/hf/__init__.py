"""Hugging Face interop: safetensors files, the name mapping, and import/export of checkpoints."""

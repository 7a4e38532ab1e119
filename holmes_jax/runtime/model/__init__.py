"""The model: the decoder and its layers, the optimizer, and text generation from a checkpoint."""

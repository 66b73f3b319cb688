"""Native kernels for the decode path and the passes over the vocabulary (`native`), with
PyTorch's operations as fallback."""

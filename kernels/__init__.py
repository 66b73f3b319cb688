"""Native kernels for the decode path (`native`), with PyTorch's products as fallback."""

"""Offline tooling: building Hydra checkpoints from Hugging Face models and GGUF files
(`builder`, `sources`, `lora`), the demo checkpoint (`demo`) and a checkpoint summary
(`describe`). Never imported by a server."""

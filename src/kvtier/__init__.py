"""kvtier: move the KV cache of LLM serving between GPU, pinned host, disk and a remote store."""

__version__ = "0.1.0"

"""Adapters between kvtier and serving stacks. Import the submodule you need:
``from kvtier.integrations.hf import KVTier`` (needs ``transformers``: ``pip install kvtier[hf]``)."""

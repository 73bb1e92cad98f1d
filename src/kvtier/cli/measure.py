"""Subcommands `kvtier probe` and `kvtier bench` (placeholder until the bench layer lands)."""

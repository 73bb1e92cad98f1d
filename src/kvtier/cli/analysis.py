"""Subcommands roofline, path, specs, demo."""

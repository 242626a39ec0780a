"""Flags and settings: argparse with YAML defaults, where each setting came from, each stage's frozen settings
record."""

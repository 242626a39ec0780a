"""Stage 02: its preflight, the extraction loop, its output folder, the background launcher."""

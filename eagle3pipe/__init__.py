"""Shared code of the EAGLE-3 draft-training pipeline (the numbered scripts at the repository root stay thin).
One module per concern; docs/LAYOUT.md lists them all. The light modules (errors, cli, settings, files, outdir,
verifier, conversations, vocab, preflight, online_plan) never import torch: validation runs before any heavy import.
"""

import os

FORMAT_VERSION = 1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root: the scripts' folder

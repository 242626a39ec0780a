"""Stage 01 (and the default verifier's conversion): the records read, rendered and tokenized, --regenerate, stage
03's vocabulary selection."""

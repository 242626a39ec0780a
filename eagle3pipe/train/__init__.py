"""Stage 04: its plan, data, trainer, checkpoints, log, warm start, profile, targets check, validation measure and
the --online session."""

"""The hidden-state files between stages 02 and 04: their format, the fp8 transport, the engine's spool."""

"""The base wing: errors, faults, deadlines, what a stage inherits, the lifeline, hand-offs, progress, the devices
and the compute dtype. Imports nothing of the package above it."""

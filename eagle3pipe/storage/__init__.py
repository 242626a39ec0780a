"""Files and their ownership: output folders, the one-writer lock, the ownership record, atomic writes and manifests,
watched inputs, stage 01's rows as later stages hold them."""

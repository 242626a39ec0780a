"""Draft architectures and a draft's weights: the registry of layers --draft-arch names, the MLA draft, a draft's
files read by their headers."""

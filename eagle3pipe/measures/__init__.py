"""What a draft is worth: the acceptance measure vLLM's counters are matched to, and a draft's config against the
verifier."""

"""The verifier as an input: its config and fingerprint, its hub files, its weights and index read as the format
defines them and held to the model its config defines, its quantization, what the installed vLLM runs of it."""

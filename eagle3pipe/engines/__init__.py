"""The ways to run the verifier: the engine kinds (engines.py, the registry), vLLM's engine and its log, the CPU
connector, the HF backend and its server, stage 04 --online's engine."""

"""Shared code of the EAGLE-3 draft-training pipeline (the numbered scripts at the repository root stay thin).

Modules, one concern each:
  cli          argparse + YAML config defaults, one-line errors with exit code 2, logging
  files        atomic writes, manifests, provenance, stage-input checks
  verifier     the verifier's fingerprint and layer-id convention, read without torch
  conversations  chat datasets (ShareGPT, OpenAI messages, local files, hub, the embedded ShareGPT)
  masks        chat-template rendering and assistant-only loss masks
  vocab        verifier-vocab -> draft-vocab mapping (d2t / t2d)
  progress     tqdm on a terminal, plain lines in nohup logs
  default_model  the embedded default verifier (SmolLM2-135M-Instruct from GGUF)

Light modules (cli, files, verifier, conversations, vocab) never import torch: validation runs before any
heavy import.
"""

FORMAT_VERSION = 1

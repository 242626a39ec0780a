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
  preflight    stage 02's checks and plan (memory, disk, GPUs, TP) without loading anything
  extraction   stage 02's loop: batching, OOM split, background writer, resume, fault injection
  backends     stage 02's vLLM and HF backends
  cpu_connector  vLLM's hidden-states connector for a CPU-only torch
  hidden_states  the hs_{i}.safetensors format: validation, atomic save
  training     stage 04: cross-stage checks, data bridge into speculators, CPU compatibility, dense log
  evaluation   stage 05: held-out prompts, vLLM's spec-decode counters, the plot

Light modules (cli, files, verifier, conversations, vocab, preflight) never import torch: validation runs
before any heavy import.
"""

FORMAT_VERSION = 1

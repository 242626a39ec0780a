"""Training and serving compute the same draft: one prompt through vLLM with the draft as its eagle3 speculator, the
draft's first pass over the prompt recorded inside vLLM (the verifier's auxiliary states it was given, the tokens, the
positions, and vLLM's own logits for every position), then the same states and tokens through the draft's forward in
speculators' training model. Prints one JSON line: the largest logit difference, the logits' scale, and how many
positions agree on the top token.

    python tests/parity.py --model-path VERIFIER --draft CHECKPOINT --prompt-ids 1,2,3 [--dtype float32]

Run as its own process: vLLM runs in this process (no engine-core process), so its draft model can be read directly.
"""
import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def install(worker):
    """Inside vLLM's worker: record the draft's first call (the prefill), where every prompt position is drafted."""
    model = worker.model_runner.drafter.model
    seen = {}
    combine = model.combine_hidden_states

    def combine_and_record(h):  # h: [num_tokens, num_aux * H], the verifier's states before the draft's fc
        seen.setdefault("aux", h.detach().float().cpu().clone())
        return combine(h)

    def after_forward(module, args, kwargs, out):
        if "logits" in seen:
            return
        n = seen["aux"].shape[0]  # vLLM may pad its batch beyond the tokens it has
        hidden = out[0] if isinstance(out, tuple) else out  # [num_tokens, H]: the draft's normed output
        seen["input_ids"] = kwargs["input_ids"][:n].cpu().clone()  # token t+1 beside the state of token t
        seen["positions"] = kwargs["positions"][:n].cpu().clone()
        seen["logits"] = module.compute_logits(hidden[:n]).float().cpu()  # [n, verifier vocab], -inf off the draft's
    model.combine_hidden_states = combine_and_record
    model.register_forward_hook(after_forward, with_kwargs=True)
    worker.parity_seen = seen


def served(model_path, draft, prompt, dtype, log_path):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from eagle3pipe.engines.engine import make_llm
    from eagle3pipe.drafts.mla_draft import served_path
    llm = make_llm(model_path, tp=1, max_model_len=1024, on_gpu=False, trust_remote_code=False, dtype=dtype,
                   log_path=log_path, enable_prefix_caching=False,
                   speculative_config={"method": "eagle3", "model": served_path(draft), "num_speculative_tokens": 3})
    llm.collective_rpc(install)
    from vllm import SamplingParams
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    return llm.collective_rpc(lambda worker: worker.parity_seen)[0]


def trained(draft, seen, dtype):
    """The draft's first TTT step in speculators' training model, on vLLM's inputs -> logits [n, draft vocab]."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from eagle3pipe.drafts import mla_draft
    scope = mla_draft.layer() if mla_draft.is_mla_checkpoint(draft) else contextlib.nullcontext()
    with scope:
        cfg = Eagle3SpeculatorConfig.from_pretrained(draft)
        cfg.transformer_layer_config._attn_implementation = "sdpa"  # as stage 04 trains on a CPU
        model = Eagle3DraftModel.from_pretrained(draft, config=cfg, torch_dtype=getattr(torch, dtype)).eval()
        logits = []
        hook = model.lm_head.register_forward_hook(lambda m, a, out: logits.append(out.float()))
        n = seen["aux"].shape[0]
        with torch.no_grad():
            # training's shift (speculators' shift_batch): the state of token t beside token t+1, positions from 1
            model(hidden_states=seen["aux"][None].to(getattr(torch, dtype)), input_ids=seen["input_ids"][None],
                  document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=seen["positions"][None] + 1,
                  ttt_steps=1)
        hook.remove()
    return logits[0][0], model.d2t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--log", default="parity-engine.log")
    a = p.parse_args()
    import torch
    seen = served(a.model_path, a.draft, [int(x) for x in a.prompt_ids.split(",")], a.dtype, a.log)
    ours, d2t = trained(a.draft, seen, a.dtype)
    theirs = seen["logits"][:, torch.arange(len(d2t)) + d2t]  # back to the draft's vocabulary
    diff = (ours - theirs).abs()
    print(json.dumps({"positions": int(ours.shape[0]), "max_abs_diff": diff.max().item(),
                      "logit_scale": theirs.abs().max().item(),
                      "top1_agree": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
                      "positions_vllm": seen["positions"][:3].tolist()}))


if __name__ == "__main__":
    main()

"""The acceptance length vLLM measures, computed without vLLM: plain torch and speculators, on a CPU or a GPU.

What vLLM 0.32 does with an EAGLE-3 draft at greedy decoding, and why one teacher-forced forward reproduces it:
- The reference is the verifier's own greedy continuation T of each prompt (P prompt tokens). vLLM accepts a draft
  token while it equals the verifier's greedy token, so the accepted run at a verification point is the run of
  consecutive matches against T.
- A verification point whose last committed token is T[i+1] drafts from slot i: the verifier's auxiliary states of
  token i beside token T[i+1]. The first point is i = P-1 (prefill yields T[P] without a draft); after a accepted
  tokens and the bonus one the next point is i + a + 1.
- Draft step s at point i sees the first-pass entries at 0..i and its own steps' entries, fed its previous guess and
  its own hidden state. speculators' TTT forward (ttt_steps=k) computes exactly that at every index i at once when
  every earlier guess was right, and a later step only counts when they all were: its step-s argmax at index i is
  vLLM's s-th draft token at point i.
- vLLM always drafts k tokens and counts its statistics before cutting the output at max_tokens or EOS, so a round
  that runs past the stop still counts its k drafts and every accepted token: T runs k tokens past the stop.
acceptance length = 1 + accepted / drafts; per position s = rounds that accepted at least s+1 tokens / drafts.
"""
import time

from .. import adapters
from ..chat.masks import load_tokenizer
from ..drafts import archs
from ..engines.backends import HFBackend
from ..verifier.verifier_weights import check_loaded


def expected_acceptance(val_metrics):
    """1 + a1 + a1*a2 + ...: the expected number of tokens a step yields (the verifier's own one, plus each draft
    token accepted while every one before it was), from speculators' per-position `full_acc_{k}_epoch` (already the
    product up to position k) on the validation rows. None without them."""
    if not isinstance(val_metrics, dict):
        return None
    ks = sorted(int(k[len("full_acc_"):-len("_epoch")]) for k in val_metrics
                if k.startswith("full_acc_") and k.endswith("_epoch") and k[len("full_acc_"):-len("_epoch")].isdigit())
    if not ks:
        return None
    return round(1 + sum(float(val_metrics[f"full_acc_{k}_epoch"]) for k in ks), 6)


def simulate(pred_ids_per_step, tokens, prompt_len, k, max_new_tokens, stop_ids):
    """vLLM's rounds over one prompt. `pred_ids_per_step[s][i]`: the draft's step-s guess (verifier vocabulary) at
    index i, the slot of token T[i+1] beside the states of token i; `tokens`: prompt + greedy continuation of at
    least max_new_tokens + k tokens (EOS not stopping it). -> (drafts, accepted, per_position_counts)."""
    need = prompt_len + max_new_tokens + k
    if len(tokens) < need:
        raise ValueError(f"the reference holds {len(tokens)} tokens; rounds near the stop read up to {need} "
                         f"(prompt {prompt_len} + max_new_tokens {max_new_tokens} + k {k})")
    stops = set(stop_ids)
    drafts = accepted = 0
    per_pos = [0] * k
    i, n_out = prompt_len - 1, 1  # prefill's token T[P] comes without a draft
    done = tokens[prompt_len] in stops or max_new_tokens <= 1
    while not done:
        a = 0
        while a < k and pred_ids_per_step[a][i] == tokens[i + 2 + a]:
            a += 1
        drafts += 1
        accepted += a
        for s in range(a):
            per_pos[s] += 1
        for tok in tokens[i + 2:i + 3 + a]:  # the accepted tokens and the bonus, cut at the stop as vLLM's output
            n_out += 1
            if tok in stops or n_out >= max_new_tokens:
                done = True
                break
        i += a + 1
    return drafts, accepted, per_pos


def position_hits(pred_ids_per_step, tokens, start, end):
    """The trainer's count on the same predictions, at every index i in [start, end) rather than only the points
    vLLM visits. -> (indices, [indices whose steps 0..s all match T, for each step s]); the trainer's estimate is
    1 + sum(hits) / indices."""
    ok, hits = [True] * (end - start), []
    for s, pred in enumerate(pred_ids_per_step):
        ok = [o and i + 2 + s < len(tokens) and pred[i] == tokens[i + 2 + s] for o, i in zip(ok, range(start, end))]
        hits.append(sum(ok))
    return end - start, hits


def output_length(tokens, prompt_len, max_new_tokens, stops):
    """How many tokens vLLM's greedy output holds: up to the first stop token, at most max_new_tokens."""
    for n, tok in enumerate(tokens[prompt_len:prompt_len + max_new_tokens], 1):
        if tok in stops:
            return n
    return max_new_tokens


def load_draft(path, dtype="float32", device="cpu", verifier_path=None):
    """A stage 04 checkpoint in speculators' training model, as the parity test loads it (a draft layer of our own
    through archs.known). `verifier_path`: where the verifier is now (the config records the path stage 04 was
    given, perhaps relative to another folder; speculators reads the verifier's embeddings from it when the
    checkpoint has none). -> (model, its aux layer ids)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    with archs.known():  # a layer of our own (the MLA draft's) is known to speculators
        cfg = Eagle3SpeculatorConfig.from_pretrained(path)
        adapters.use_sdpa(cfg.transformer_layer_config)
        if verifier_path:
            cfg.speculators_config.verifier.name_or_path = str(verifier_path)
        model = Eagle3DraftModel.from_pretrained(path, config=cfg, torch_dtype=getattr(torch, dtype)).eval()
    return model.to(device), list(cfg.eagle_aux_hidden_state_layer_ids)


def draft_predictions(model, aux, tokens, k):
    """One teacher-forced TTT forward over prompt + continuation. `aux`: [L, n_aux * H] (or [L, n_aux, H]) the
    verifier's auxiliary states of every token (the last one unused); `tokens`: the L token ids. -> [k, L-1] long
    tensor of step-s guesses in the verifier's vocabulary (draft id + d2t[draft id]; a draft with the verifier's whole
    vocabulary has no d2t: its ids are the verifier's)."""
    import torch
    p = next(model.parameters())
    aux = torch.as_tensor(aux)
    aux = aux.flatten(1) if aux.dim() == 3 else aux
    ids = torch.as_tensor(tokens, dtype=torch.long, device=p.device)
    n = ids.numel() - 1
    with torch.no_grad(), adapters.uncompiled():  # a prompt's length a call: nothing to reuse a compiled graph for
        # training's shift: the state of token i beside token i+1, positions from 1 (RoPE is relative: vLLM's i)
        steps = model(hidden_states=aux[:n][None].to(p.device, p.dtype), input_ids=ids[1:][None],
                      document_ids=torch.zeros(1, n, dtype=torch.long, device=p.device),
                      position_ids=torch.arange(1, n + 1, device=p.device)[None], ttt_steps=k)
    if model.d2t is None:
        return torch.stack([s[0] for s in steps]).cpu()
    d2t = model.d2t.to(p.device)
    return torch.stack([s[0] + d2t[s[0]] for s in steps]).cpu()


def stop_ids(verifier_path, trust_remote_code=False):
    """What ends vLLM's greedy output: the tokenizer's EOS and the generation config's eos ids."""
    from transformers import GenerationConfig
    tok = load_tokenizer(verifier_path, trust_remote_code)
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(verifier_path).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return sorted(ids)


class Verifier:
    """The HF verifier with forward hooks on the auxiliary layers (the layer-id convention of verifier.py: id j < n
    is the input of decoder layer j, id n the last layer's output before the final norm)."""

    def __init__(self, path, layer_ids, dtype="float32", device="cpu", trust_remote_code=False):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model, info = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                                trust_remote_code=trust_remote_code,
                                                                output_loading_info=True)
        check_loaded(info, path)  # never a verifier with a weight at random
        self.model = self.model.to(device).eval()
        self.device, self.layer_ids, self.seen = device, list(layer_ids), {}
        layers = HFBackend._decoder_layers(self.model)
        n = len(layers)
        for slot, j in enumerate(self.layer_ids):
            if j < n:
                layers[j].register_forward_pre_hook(self._keep(slot, True), with_kwargs=True)
            else:
                layers[n - 1].register_forward_hook(self._keep(slot, False), with_kwargs=True)

    def _keep(self, slot, pre):
        def hook(module, args, kwargs, out=None):
            h = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]) if pre else \
                (out[0] if isinstance(out, (tuple, list)) else out)
            self.seen.setdefault(slot, []).append(h[0].detach())
        return hook

    def reference(self, prompt_ids, n_new):
        """Greedy decoding with the KV cache (plain argmax: vLLM's temperature 0, no generation-config penalties),
        EOS not stopping it. -> (prompt + n_new tokens, aux [L, n_aux * H] float32 on the CPU, the last token's row
        zero: it is never fed)."""
        torch = self.torch
        self.seen.clear()
        tokens = list(prompt_ids)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([tokens], device=self.device), use_cache=True)
            for step in range(n_new):
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                if step < n_new - 1:
                    out = self.model(input_ids=torch.tensor([[nxt]], device=self.device),
                                     past_key_values=out.past_key_values, use_cache=True)
        aux = torch.cat([torch.cat(self.seen[s], 0)[:, None] for s in range(len(self.layer_ids))], 1).flatten(1)
        self.seen.clear()
        aux = torch.cat([aux.float().cpu(), aux.new_zeros(1, aux.shape[1]).float().cpu()])
        return tokens, aux


def references(verifier_path, prompts_ids, k, max_new_tokens, layer_ids, dtype="float32", device="cpu",
               trust_remote_code=False):
    """Each prompt's greedy continuation (max_new_tokens + k tokens) and the auxiliary states over it. ->
    [{"tokens", "aux", "prompt_len"}]."""
    ver = Verifier(verifier_path, layer_ids, dtype, device, trust_remote_code)
    refs = []
    for ids in prompts_ids:
        tokens, aux = ver.reference(ids, max_new_tokens + k)
        refs.append({"tokens": tokens, "aux": aux, "prompt_len": len(ids)})
    del ver
    return refs


def score(model, refs, k, max_new_tokens, stops):
    """The draft over stored references -> {"acceptance_length", "per_position", "drafts", "accepted",
    "per_prompt": [[drafts, accepted]], "position_average": the trainer's formula over every index of the same
    outputs}."""
    drafts = accepted = n_all = 0
    per_pos, per_prompt, hits_all = [0] * k, [], [0] * k
    for ref in refs:
        pred = draft_predictions(model, ref["aux"], ref["tokens"], k).tolist()
        p = ref["prompt_len"]
        d, a, pos = simulate(pred, ref["tokens"], p, k, max_new_tokens, stops)
        drafts, accepted = drafts + d, accepted + a
        per_pos = [x + y for x, y in zip(per_pos, pos)]
        per_prompt.append([d, a])
        n, hits = position_hits(pred, ref["tokens"], p - 1, p - 2 + output_length(ref["tokens"], p, max_new_tokens,
                                                                                     set(stops)))
        n_all, hits_all = n_all + n, [x + y for x, y in zip(hits_all, hits)]
    return {"acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
            "per_position": [round(x / drafts, 4) for x in per_pos] if drafts else [],
            "drafts": drafts, "accepted": accepted, "per_prompt": per_prompt,
            "position_average": round(1 + sum(hits_all) / n_all, 4) if n_all else None}


def measure(draft_path, verifier_path, prompts_ids, k, max_new_tokens, dtype="float32", device="cpu",
            trust_remote_code=False):
    """The acceptance length vLLM would measure for `draft_path` on these prompts (token ids, chat template
    applied) at greedy decoding with k speculative tokens. -> score()'s dict plus "seconds" (the draft's part) and
    "reference_seconds" (the verifier's continuations, made once for any number of drafts)."""
    model, layer_ids = load_draft(draft_path, dtype, device, verifier_path)
    t0 = time.time()
    refs = references(verifier_path, prompts_ids, k, max_new_tokens, layer_ids, dtype, device, trust_remote_code)
    t1 = time.time()
    out = score(model, refs, k, max_new_tokens, stop_ids(verifier_path, trust_remote_code))
    out.update(reference_seconds=round(t1 - t0, 2), seconds=round(time.time() - t1, 2))
    return out


MEASURE_MAX_WEIGHT_BYTES = 10 << 30  # auto: a verifier this small also runs in float32 through transformers, here


def measure_all(drafts, verifier_path, prompts_ids, k, max_new_tokens, device="cpu", trust_remote_code=False):
    """Stage 05's measure beside vLLM: each (name, path) draft on the same prompts; one set of references per set of
    auxiliary layer ids (the verifier runs once for drafts of one run). Float32, where agreement with vLLM's counters
    was shown. -> {name: score()'s dict plus "seconds"}, and the seconds the references took."""
    loaded = [(name, *load_draft(path, "float32", device, verifier_path)) for name, path in drafts]
    stops, refs, out, ref_seconds = stop_ids(verifier_path, trust_remote_code), {}, {}, 0.0
    for name, model, layer_ids in loaded:
        key = tuple(layer_ids)
        if key not in refs:
            t0 = time.time()
            refs[key] = references(verifier_path, prompts_ids, k, max_new_tokens, layer_ids, "float32", device,
                                   trust_remote_code)
            ref_seconds += time.time() - t0
        t0 = time.time()
        out[name] = score(model, refs[key], k, max_new_tokens, stops)
        out[name]["seconds"] = round(time.time() - t0, 2)
    return out, round(ref_seconds, 2)

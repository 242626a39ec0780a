"""Stage 04's training targets against the verifier's own next-token distribution, on a few stored rows, before
training.

speculators computes the draft's targets from the verifier's last hidden state (layer id n, before the final norm)
as `verifier_lm_head(verifier_norm(h))`: the draft family's RMSNorm (`x * w`) holding the verifier's
`model.norm.weight`, then the verifier's head restricted to the draft vocabulary. A family whose own head computes
otherwise trains the draft toward another distribution, in silence: Gemma's norm is `x * (1 + w)` (its top-1 agreed
with the verifier's on 24 % of the trained positions of a real Gemma 3), Gemma 2 caps its logits (`tanh`), Cohere and
Granite scale them.

The verifier's own distribution is computed by its own code: transformers' class for the family, built on the meta
device with no decoder layer, its final norm loaded from the checkpoint and its head cut to the draft vocabulary's
rows (the embeddings' where tied), called with the stored state as its input embeddings: whatever its forward does after the last layer (the norm, a cap, a
scale) runs as the verifier runs it. (Anything it does to the input embeddings is a scale, which a final RMSNorm or
LayerNorm does not see.) The two are compared on the trained positions of up to ROWS rows:
- they agree: speculators' targets are trained on as they are;
- the verifier's own final norm, put in speculators' place (adapters.own_verifier_norm), agrees: the run trains with
  it (the plan says so);
- neither: refused in one line naming the family, before anything is written.
Agreement: the same top-1 token (within the draft vocabulary) on at least AGREE of the positions, and a mean KL
below MAX_KL nats (a cap or a scale keeps the top-1 and flattens the distribution).
"""
import dataclasses
import logging
import os

from ..base.compile_cache import setting_kept
from ..base.errors import UsageError
from ..drafts import archs
from ..formats.hidden_states import dequantize, hs_path, load_checked
from ..storage.files import read_json
from ..verifier import verifier_weights
from ..verifier.quantization import tensor_table
from ..verifier.verifier import text_config

log = logging.getLogger("eagle3")

ROWS, MAX_TOKENS = 4, 2048   # rows read for the check, and trained positions compared at most
AGREE, MAX_KL = 0.99, 1e-3   # what "the same distribution" means (float32 on both sides: ~1e-7 nats when equal)


@dataclasses.dataclass(frozen=True)
class Verdict:
    use_own_norm: bool   # train with the verifier's own final norm in speculators' place
    top1: float          # agreement of the targets trained on (after the adaptation, if any)
    kl: float
    positions: int
    default_top1: float  # speculators' own targets, for the record
    norm: object = None  # the verifier's own final norm module, where it takes speculators' place

    def describe(self):
        how = ("with the verifier's own final norm in speculators' place (its default computes "
               f"{self.default_top1:.1%} of them otherwise)" if self.use_own_norm else "as speculators computes them")
        return (f"training targets equal the verifier's own next-token distribution on {self.top1:.2%} of "
                f"{self.positions:,} trained positions (KL {self.kl:.1e} nats), {how}")


def own_head(model_path, text_cfg, tensors, head, trust_remote_code):
    """The verifier's CausalLM with no decoder layer, on the CPU in float32: its output embeddings `head` (the rows of
    the draft vocabulary: the cap or scale its forward applies is per logit, so these logits are the full head's),
    input embeddings of one row (the stored state is given as the input), and its other weights (the final norm) from
    `tensors`: {name as its definition saves it: tensor}. Memory: the draft vocabulary's rows, not the verifier's."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type = text_cfg.get("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in text_cfg.items() if k != "model_type"}) \
        if model_type in transformers.CONFIG_MAPPING else AutoConfig.from_pretrained(
            model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    base = getattr(model, model.base_model_prefix)
    del base.layers[:]  # no decoder layer: the stored state is the last layer's output
    hidden = head.shape[1]
    with torch.device("meta"):
        model.set_input_embeddings(torch.nn.Embedding(1, hidden))
        model.set_output_embeddings(torch.nn.Linear(hidden, head.shape[0], bias=False))
    model.to_empty(device="cpu")
    model.float()
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(head)
        state = model.state_dict()
        for name in state:
            if name in tensors and tensors[name].shape == state[name].shape:
                state[name].copy_(tensors[name].float())
    return model.eval()


def _read_weights(model_path, table, names):
    """{want: tensor} for {want: the checkpoint's name}; `table`: quantization.tensor_table's (read once)."""
    from safetensors import safe_open
    out = {}
    for want, stored in names.items():
        if stored in table:
            with safe_open(os.path.join(model_path, table[stored][2]), "pt") as f:
                out[want] = f.get_tensor(stored)
    return out


def check(s, tc, ext, rows, failed, draft_arch):
    """-> Verdict for stage 04's settings `s` (`tc`: the verifier's text config; `ext`: train_data.States; `rows`
    and `failed`: the rows trained on and those stage 02 could not extract; `draft_arch`: the draft family whose norm
    speculators builds the targets with), None where no row's states could be read, or raises UsageError. Offline
    runs only: the states are read from stage 02's files."""
    with setting_kept():  # stage 04 chooses the compile cache after the plan (compile_cache.py)
        return _check(s, tc, ext, rows, failed, draft_arch)


def _check(s, tc, ext, rows, failed, draft_arch):
    import numpy as np
    import torch
    from speculators.utils.loading import _resolve_key
    # the rows' last hidden states and the trained positions (token t's state predicts token t + 1)
    states, masks = [], []
    for i, row in enumerate(rows):
        if len(states) >= ROWS:
            break
        ids, mask = row[0], row[1]
        if i in failed:
            continue
        why, t = load_checked(hs_path(s.hidden_states, i), ids, len(ext.layer_ids), ext.hidden_size)
        if why:
            continue
        h = dequantize(t)[:, -1, :].float()           # [T, H]: id n, before the final norm
        m = torch.as_tensor(np.asarray(mask[1:], dtype=bool))  # [T - 1]: state t is trained toward token t + 1
        states.append(h[:-1][m])
        masks.append(int(m.sum()))
    if not states:
        return None
    h = torch.cat(states)[:MAX_TOKENS]                # [P, H]
    t2d = torch.as_tensor(np.load(os.path.join(s.vocab_mapping, "t2d.npy")))
    ids = torch.nonzero(t2d).squeeze(-1)              # the draft vocabulary's verifier ids
    # speculators' targets, from the tensors it would load (its own name resolution) and its own norm class
    table = tensor_table(s.model_path)
    found = {n: _resolve_key(n, table) for n in ("embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    w = _read_weights(s.model_path, table, {n: k for n, k in found.items() if k})
    head = w.get("lm_head.weight", w["embed_tokens.weight"]).float()[ids]   # [V_draft, H]
    norm_class = _norm_class(draft_arch)
    spec_norm = norm_class(h.shape[-1], eps=tc.get("rms_norm_eps") or 1e-6)
    with torch.no_grad():
        spec_norm.weight.copy_(w["model.norm.weight"].float())
    # the verifier's own: its class, no layer, its weights
    d = verifier_weights.definition(*_configs(s.model_path), s.model_path, s.trust_remote_code)
    if d is None:
        raise UsageError(f"--model-path {s.model_path}: transformers does not know model_type {tc.get('model_type')!r}, "
                         f"so the training targets cannot be checked against the verifier's own distribution")
    stored = verifier_weights.stored_names({k: (v[0], v[1], None, None, v[2]) for k, v in table.items()}, d)
    embed, out = d.embedding, "lm_head.weight"
    names = {n: stored(n) for n in d.tensors if ".layers." not in n and n not in (embed, out)}  # the final norm
    own_rows = _read_weights(s.model_path, table,
                             {"head": stored(out if out in d.tensors and out not in d.tied else embed)})
    model = own_head(s.model_path, tc, _read_weights(s.model_path, table, names), own_rows["head"].float()[ids],
                     s.trust_remote_code)
    with torch.no_grad():
        own = torch.log_softmax(model(inputs_embeds=h[None], use_cache=False).logits[0].float(), -1)  # [P, V_draft]
        final = getattr(getattr(model, model.base_model_prefix), "norm", None)

        def compare(norm):
            got = torch.log_softmax(norm(h) @ head.T, dim=-1)
            top1 = (got.argmax(-1) == own.argmax(-1)).float().mean().item()
            kl = (own.exp() * (own - got)).sum(-1).mean().item()
            return top1, kl
        top1, kl = compare(spec_norm)
        if top1 >= AGREE and kl < MAX_KL:
            return Verdict(False, top1, kl, len(h), top1)
        if final is not None and set(final.state_dict()) == {"weight"}:  # speculators saves no verifier_norm.weight
            top1_own, kl_own = compare(final)
            if top1_own >= AGREE and kl_own < MAX_KL:
                return Verdict(True, top1_own, kl_own, len(h), top1, final)
    raise UsageError(f"--model-path {s.model_path}: speculators would train the draft toward targets that are not "
                     f"the verifier's: on {len(h):,} trained positions of stage 02's states they agree with a "
                     f"{d.arch}'s own next token on {top1:.1%} (KL {kl:.2f} nats); its family "
                     f"({tc.get('model_type')}) computes its logits otherwise after the last layer (a final norm, a "
                     f"cap or a scale this pipeline does not adapt); refused before training")


def _configs(model_path):
    cfg = read_json(os.path.join(model_path, "config.json"), once=True)
    return cfg, text_config(cfg)


def _norm_class(draft_arch):
    """The RMSNorm speculators builds the targets' norm from: the draft family's (its layer config's model_type)."""
    from speculators.models.eagle3.model_definitions import model_classes
    arch = archs.ARCHS[draft_arch]
    with arch.scope():
        return model_classes[arch.layer_type].norm_class

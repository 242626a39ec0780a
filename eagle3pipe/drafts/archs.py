"""The draft architectures `--draft-arch` names: one record of facts per kind, as engines/engines.py holds the
backends'. Every stage asks this registry; no module compares an architecture's name.

A new architecture is one entry in ARCHS and, for a decoder layer speculators does not build itself, one module in
this folder with the hooks `own_layer` is used for (mla_draft.py is the one there is: `misfit`, `layer_config`,
`layer`), plus adapters.py where speculators or vLLM needs adapting (its SERVES check per `draft_arch`)."""
import contextlib
import dataclasses
from typing import Callable, Optional

from . import mla_draft


@dataclasses.dataclass(frozen=True)
class DraftArch:
    name: str                       # --draft-arch, the recipe's draft_arch
    layer_type: str                 # its decoder layer's model_type among speculators' model classes (its norm)
    label: str                      # how messages name it
    # the module that builds a layer speculators has not (a config written before training, speculators' public
    # draft_config, its classes put into speculators' map for the run: mla_draft.py), or None: speculators' own
    own_layer: Optional[object] = None
    norm_before_fc: bool = True     # --norm-before-fc's default when --fc-norm is off
    attention: str = "mha"          # "mla": multi-head latent attention (vLLM's CPU kernels differ for it)
    preferred: Callable = staticmethod(lambda fp, text_cfg: False)  # --draft-arch auto picks it for this verifier

    def misfit(self, text_cfg):
        """Why this verifier cannot take the draft's own layer (None: it can; speculators' layers: see training)."""
        return self.own_layer.misfit(text_cfg) if self.own_layer else None

    def scope(self):
        """While inside, speculators knows the draft's layer (a layer of its own: nothing to do)."""
        return self.own_layer.layer() if self.own_layer else contextlib.nullcontext()


LLAMA = DraftArch("llama", "llama", "Llama-style")
ARCHS = {a.name: a for a in (
    LLAMA,
    DraftArch("qwen3", "qwen3", "Qwen3-style",
              preferred=lambda fp, text_cfg: str(fp.get("model_type") or "").startswith("qwen3")),
    # vLLM's MLA draft has the per-state fc_norm instead of a norm before the FC layer
    DraftArch("deepseek", mla_draft.MODEL_TYPE, "MLA", own_layer=mla_draft, norm_before_fc=False, attention="mla",
              preferred=lambda fp, text_cfg: mla_draft.is_mla(text_cfg)),
)}


def of(recipe):
    """The recipe's draft layer (a stage 04 recipe or manifest's `recipe`). -> DraftArch"""
    return ARCHS[recipe["draft_arch"]]


def auto(fp, text_cfg):
    """--draft-arch auto -> (the architecture, why a preferred one was passed over or None): the verifier's own family
    where there is a draft layer for it and the verifier fits it, else Llama's."""
    for arch in ARCHS.values():
        if arch.preferred(fp, text_cfg):
            why = arch.misfit(text_cfg)
            if why:
                return LLAMA, f"a {LLAMA.label} draft, not the {arch.label} one: {why}"
            return arch, None
    return LLAMA, None


@contextlib.contextmanager
def known():
    """While inside, speculators knows every draft layer of ours (each own layer's classes in its map)."""
    with contextlib.ExitStack() as stack:
        for arch in ARCHS.values():
            stack.enter_context(arch.scope())
        yield

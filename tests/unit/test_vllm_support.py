"""Which verifier architectures the installed vLLM runs EAGLE-3 for, read from its source (vllm_support.py). The
answers were compared once with vLLM's own runtime check (`supports_eagle3` of each registered class that loads on
this machine): 223 decided alike, none apart; 68 the source alone cannot decide are never refused."""
from eagle3pipe.verifier import vllm_support


def test_the_installed_vllm_s_answers_for_the_families_users_bring():
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"):
        assert vllm_support.eagle3_refusal(arch) is None, arch  # Phi3 through LlamaForCausalLM, imported
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        why = vllm_support.eagle3_refusal(arch)
        assert why and f"no EAGLE-3 support for {arch}" in why and "SupportsEagle3" in why, why
    assert vllm_support.eagle3_refusal("NoSuchModelForCausalLM") is None  # cannot tell: never refused
    assert vllm_support.eagle3_refusal(None) is None  # read, not imported: C/test_unlisted_architectures.py checks


def test_a_base_chosen_at_import_time_cannot_be_told():
    # llama.py: `if TYPE_CHECKING: Base = LlamaForCausalLM else: Base = as_embedding_model(...)`; a class on it is
    # neither a yes nor a no from the source
    assert vllm_support._supports("llama", "LlamaBidirectionalModel") is None
    assert vllm_support._supports("llama", "LlamaForCausalLM") is True
    assert vllm_support._supports("gemma2", "Gemma2ForCausalLM") is False


def test_only_a_definite_no_refuses(tmp_path, monkeypatch):
    """vLLM source shapes the installed version does not have yet: a base reached through a star import, a package's
    re-export or a module attribute, a class bound twice, an architecture given two classes or set by assignment,
    a plugin that may register classes. Each is "cannot tell", never a refusal; a plain class without the
    interface is still a no."""
    (tmp_path / "llama.py").write_text("from .interfaces import SupportsEagle3\n"
                                       "class LlamaForCausalLM(nn.Module, SupportsEagle3):\n    pass\n")
    (tmp_path / "interfaces.py").write_text("class SupportsEagle3(Protocol):\n    supports_eagle3 = True\n")
    (tmp_path / "star.py").write_text("from .llama import *\nclass M(LlamaForCausalLM):\n    pass\n")
    (tmp_path / "attr.py").write_text("from . import llama\nclass M(llama.LlamaForCausalLM):\n    pass\n")
    (tmp_path / "pkg.py").write_text("from vllm.model_executor.models import LlamaForCausalLM\n"
                                     "class M(LlamaForCausalLM):\n    pass\n")
    (tmp_path / "twice.py").write_text("class M(nn.Module):\n    pass\nM = make_eagle3(M)\n")
    (tmp_path / "plain.py").write_text("from torch import nn\nfrom typing import Generic\n"
                                       "class M(nn.Module, Generic[T]):\n    pass\n")
    (tmp_path / "follows.py").write_text("from .llama import LlamaForCausalLM as L\nclass M(L):\n    pass\n")
    (tmp_path / "registry.py").write_text(
        "A = {'Star': ('star', 'M'), 'Attr': ('attr', 'M'), 'Pkg': ('pkg', 'M'), 'Twice': ('twice', 'M'),\n"
        "     'Plain': ('plain', 'M'), 'Follows': ('follows', 'M'), 'Both': ('plain', 'M'), 'Set': ('plain', 'M')}\n"
        "B = {'Both': ('llama', 'LlamaForCausalLM')}\nA['Set'] = ('llama', 'LlamaForCausalLM')\n")
    monkeypatch.setattr(vllm_support, "_models_dir", lambda: str(tmp_path))  # the source read, not the reading
    for cached in (vllm_support._tree, vllm_support.registry):
        cached.cache_clear()
    try:
        assert vllm_support.registry()["Both"] is None and vllm_support.registry()["Set"] is None
        for arch in ("Star", "Attr", "Pkg", "Twice", "Both", "Set", "Follows"):
            assert vllm_support.eagle3_refusal(arch) is None, arch
        assert vllm_support._supports("follows", "M") is True
        assert "no EAGLE-3 support for Plain" in vllm_support.eagle3_refusal("Plain")
    finally:
        for cached in (vllm_support._tree, vllm_support.registry):
            cached.cache_clear()

"""Which verifier architectures the installed vLLM runs EAGLE-3 for, read from its source (vllm_support.py). The
answers were compared once with vLLM's own runtime check (`supports_eagle3` of each registered class that loads on
this machine): 225 decided alike, none apart; 66 the source alone cannot decide are never refused."""
from eagle3pipe import vllm_support


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

"""Loss masks by render boundaries, on the real SmolLM2 tokenizer (ChatML with an injected default system
prompt) and on Llama-3, Qwen-2.5 and Mistral template families kept as fixtures."""
import copy
import os

import pytest

from conftest import FIXTURES
from eagle3pipe import masks


CONV = [
    {"role": "user", "content": "Hi there, who are you?"},
    {"role": "assistant", "content": "I am a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
]


def masked_spans(tok, ids, mask):
    """Decoded text of each contiguous run of loss_mask == 1."""
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur)); cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def with_template(tok, name, specials, **named):
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": specials, **named})
    with open(os.path.join(FIXTURES, "templates", name)) as f:
        t.chat_template = f.read()
    return t


def test_chatml_masks_exactly_the_assistant_turns(tokenizer):
    ids, mask, info = masks.tokenize_conversation(tokenizer, CONV, 4096)
    assert len(ids) == len(mask)
    assert masked_spans(tokenizer, ids, mask) == ["I am a helpful assistant.<|im_end|>\n", "2+2 equals 4.<|im_end|>\n"]
    # the ids are exactly what the template renders, tokenized as transformers would
    full = tokenizer.apply_chat_template(CONV, tokenize=False)
    assert tokenizer.decode(ids) == full
    assert "You are a helpful AI assistant named SmolLM" in full  # the injected default system prompt
    assert info == {"unaligned": 0, "truncated": False}


def test_system_prompt_given_and_conversation_opening_with_assistant(tokenizer):
    conv = [{"role": "system", "content": "Be brief."}] + CONV
    ids, mask, _ = masks.tokenize_conversation(tokenizer, conv, 4096)
    assert masked_spans(tokenizer, ids, mask)[0] == "I am a helpful assistant.<|im_end|>\n"
    assert "SmolLM" not in tokenizer.decode(ids)
    ids, mask, _ = masks.tokenize_conversation(tokenizer, CONV[1:], 4096)
    assert masked_spans(tokenizer, ids, mask) == ["I am a helpful assistant.<|im_end|>\n", "2+2 equals 4.<|im_end|>\n"]


def test_llama3_template(tokenizer):
    tok = with_template(tokenizer, "llama3.jinja", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                        bos_token="<|begin_of_text|>")
    ids, mask, _ = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|eot_id|>", "2+2 equals 4.<|eot_id|>"]
    assert tok.decode(ids[:1]) == "<|begin_of_text|>"
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)


def test_qwen_template_injects_default_system_prompt(tokenizer):
    tok = with_template(tokenizer, "qwen2.5.jinja", [])
    ids, mask, _ = masks.tokenize_conversation(tok, CONV, 4096)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|im_end|>\n", "2+2 equals 4.<|im_end|>\n"]
    # nothing of the system prompt or the user turns is trained
    assert sum(mask) == len(tok("I am a helpful assistant.<|im_end|>\n2+2 equals 4.<|im_end|>\n",
                                add_special_tokens=False)["input_ids"])


def test_mistral_template_end_of_turn_and_refusal(tokenizer):
    tok = with_template(tokenizer, "mistral.jinja", ["[INST]", "[/INST]"])
    ids, mask, _ = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant." + tok.eos_token,
                                            "2+2 equals 4." + tok.eos_token]
    with pytest.raises(masks.TemplateError, match="alternate"):
        masks.tokenize_conversation(tok, [CONV[0], CONV[0], CONV[1]], 4096)


def test_history_rewriting_template_leaves_turns_untrained(tokenizer):
    """A template that drops earlier answers (as reasoning templates drop earlier thinking): the earlier
    turn cannot be located in the full render and is counted, not guessed."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
                         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert info["unaligned"] == 1
    assert masked_spans(tok, ids, mask) == ["2+2 equals 4.<|im_end|>\n"]


def test_truncation(tokenizer):
    ids, mask, info = masks.tokenize_conversation(tokenizer, CONV, 40)
    assert len(ids) == len(mask) == 40 and info["truncated"]
    full_ids, full_mask, _ = masks.tokenize_conversation(tokenizer, CONV, 4096)
    assert ids == full_ids[:40] and mask == full_mask[:40]

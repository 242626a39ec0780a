"""Loss masks by render boundaries, on the real SmolLM2 tokenizer (ChatML with an injected default system
prompt) and on Llama-3, Qwen-2.5 and Mistral template families kept as fixtures; templates that close a render with
extra text (Phi-3), render the last answer otherwise (Qwen3), open the answer in the generation prompt
(DeepSeek-R1); and a SentencePiece-style tokenizer (Llama-2, Mistral v0.x), built here with `tokenizers`."""
import copy
import os

import pytest

from conftest import FIXTURES, verifier_files
from eagle3pipe.chat import masks


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
    assert info == {"unaligned": 0, "truncated": False, "answered": True, "after_stop": 0}


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


PHI3 = ("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")
# Qwen3's rule: an answer after the last user turn opens with a thinking block, empty when there is none; earlier
# answers are rendered without one
QWEN3 = ("{% for m in messages %}{% if m.role == 'assistant' and loop.last %}"
         "{{ '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' + m.content + "
         "'<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
R1 = ("{% for m in messages %}{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}{% else %}"
      "{{ '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def templated(tok, template, specials):
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": specials})
    t.chat_template = template
    return t


def test_a_template_that_closes_every_render_trains_every_turn(tokenizer):
    """Phi-3 ends a render without a generation prompt with its end-of-text: no earlier turn's render was a prefix of
    the whole, and every turn but the last was left untrained, without a word."""
    tok = templated(tokenizer, PHI3, ["<|user|>", "<|assistant|>", "<|end|>"])
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|end|>\n",
                                            "2+2 equals 4.<|end|>\n" + tok.eos_token]
    assert info["unaligned"] == 0


def test_a_last_answer_rendered_otherwise_than_earlier_ones_trains_every_turn(tokenizer):
    """Qwen3: the earlier answer is trained as the whole conversation renders it, the last one with its block."""
    tok = templated(tokenizer, QWEN3, ["<think>", "</think>"])
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|im_end|>\n",
                                            "<think>\n\n</think>\n\n2+2 equals 4.<|im_end|>\n"]
    assert info["unaligned"] == 0
    conv = CONV[:3] + [dict(CONV[3], reasoning_content="Add them.")]
    ids, mask, _ = masks.tokenize_conversation(tok, conv, 4096)
    assert masked_spans(tok, ids, mask)[1] == "<think>\nAdd them.\n</think>\n\n2+2 equals 4.<|im_end|>\n"


def test_a_generation_prompt_that_opens_the_answer(tokenizer):
    """DeepSeek-R1 prompts with "<think>\\n" that its rendered answer lacks: every turn was dropped and the data
    blamed. The answer is trained from where the prompt and the render part."""
    tok = templated(tokenizer, R1, ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>"])
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<｜end▁of▁sentence｜>",
                                            "2+2 equals 4.<｜end▁of▁sentence｜>"]
    assert info["unaligned"] == 0


def test_an_opening_answer_keeps_its_first_characters(tokenizer):
    # the render of an empty answer agreed with "<b>" up to its "<" (of "<|im_end|>"): the "<" was context
    conv = [{"role": "assistant", "content": "<b>Welcome</b>"}] + CONV[:2]
    ids, mask, _ = masks.tokenize_conversation(tokenizer, conv, 4096)
    assert masked_spans(tokenizer, ids, mask) == ["<b>Welcome</b><|im_end|>\n", "I am a helpful assistant.<|im_end|>\n"]


def test_a_template_that_moves_earlier_text_leaves_those_turns_untrained(tokenizer):
    """Mistral v0.3 puts the system prompt on the last user turn only: an earlier answer's context is not the whole
    render's, and no span is guessed."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% set sys = messages[0].content if messages[0].role == 'system' else '' %}"
                         "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}"
                         "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
                         "{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + (sys + '\\n\\n' if loop.index0"
                         " == ns.last and sys else '') + m.content + '[/INST]' }}{% elif m.role == 'assistant' %}"
                         "{{ m.content + eos_token }}{% endif %}{% endfor %}")
    ids, mask, info = masks.tokenize_conversation(tok, [{"role": "system", "content": "Be brief."}] + CONV, 4096)
    assert info["unaligned"] == 1
    assert masked_spans(tok, ids, mask) == ["2+2 equals 4." + tok.eos_token]


def test_a_turn_whose_header_the_generation_prompt_does_not_write_is_left_untrained(tokenizer):
    """Found by a held-out probe: a generation prompt that is not the rendered turn's own header (a turn number, the
    role named "bot" in the turn and "assistant" in the prompt) trained the header's rest as the answer's first
    tokens. Prompt and render part before the answer does: the turn is unaligned, counted, and not trained; the
    R1-style prompt that opens the answer (above) still trains."""
    for template in (
            "{% for m in messages %}### Turn {{ loop.index }}\n{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}### Turn next\nassistant: {% endif %}",
            "{% for m in messages %}<|im_start|>{{ 'bot' if m.role == 'assistant' else m.role }}\n{{ m.content }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"):
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = template
        ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
        assert info["unaligned"] == 2 and not any(mask), masked_spans(tok, ids, mask)


def test_answers_whose_text_reaches_no_trained_token_are_not_trained(tokenizer):
    """Found by a held-out probe: a template that renders the answer empty kept rows whose only trained tokens were
    "<|im_end|>\n": the draft would learn where turns end and nothing of the verifier's answers."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}"
                         "{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["<|im_end|>\n", "<|im_end|>\n"] and info["answered"] is False


def test_what_follows_a_stop_token_in_an_answer_s_span_is_not_trained(tokenizer):
    """Found by a held-out probe: vLLM ends an answer at the verifier's stop token, but a template that closes its
    last render with more text (Phi-3's end of text after the end of turn) had that text trained, and so had the rest
    of an answer that holds the end-of-turn marker itself. ChatML's newline after <|im_end|> stays: blank."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>{% endif %}")
    assert masks.stop_ids(tok) == {tok.convert_tokens_to_ids("<|im_end|>")}
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|im_end|>\n", "2+2 equals 4.<|im_end|>"]
    assert info["after_stop"] == 2
    conv = CONV[:1] + [{"role": "assistant", "content": "Done.<|im_end|>\n<|im_start|>user\nmore"}]
    ids, mask, info = masks.tokenize_conversation(tokenizer, conv, 4096)
    assert masked_spans(tokenizer, ids, mask) == ["Done.<|im_end|>"] and info["after_stop"] > 3


def test_a_template_that_renders_at_random_is_refused_before_the_folder_is_taken(tokenizer):
    """Found by a held-out probe: a template with a random choice in its header rendered each conversation
    otherwise each time; the rows then matched no other render. The first record is rendered twice."""
    from eagle3pipe.base.errors import UsageError
    from eagle3pipe.chat import tokenize_workers
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ ['user', 'human', 'person', 'you'] | random if "
                         "m.role == 'user' else m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    records = [("r0", CONV * 8, None)]  # eight user turns: the same render twice by chance is 4**-16
    with pytest.raises(UsageError, match=r"record r0: the chat template of .* renders the same conversation "
                                         r"differently each time"):
        tokenize_workers.probe(tok, records, 4096)
    tokenize_workers.probe(tokenizer, records, 4096)


def test_a_config_transformers_cannot_read_is_named_not_the_tokenizer(model_path, tmp_path):
    """Found by a held-out probe: config.json's faults (heads that do not divide the width) surfaced as the
    tokenizer's ("its tokenizer failed to load"), the message cut at its colon."""
    import json
    from eagle3pipe.base.errors import UsageError
    d = verifier_files(model_path, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 7}))
    with pytest.raises(UsageError, match=r"config.json: transformers cannot read it: \w+: .*The hidden size \(576\) "
                                         r"is not a multiple of the number of attention heads \(7\)"):
        masks.load_tokenizer(str(d))


def test_a_tokenizer_that_splits_at_random_is_refused(model_path, tmp_path):
    """BPE dropout in tokenizer.json: the same text split otherwise at every call, never as the verifier's engine
    splits it (found by a held-out probe: accepted silently)."""
    import json
    from eagle3pipe.base.errors import UsageError
    d = verifier_files(model_path, tmp_path / "tok")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["model"]["dropout"] = 0.1
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UsageError, match=r"its tokenizer.json sets BPE dropout 0.1: it splits text at random"):
        masks.load_tokenizer(str(d))


def test_a_sentencepiece_tokenizer_gets_the_render_s_own_tokens(tokenizer):
    """A SentencePiece-style tokenizer marks the start of each text it is given with a space: tokenized segment by
    segment, every answer began with a space token the verifier never generates ("▁Paris" for "Paris")."""
    import string
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    sp.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    text = [m["content"] for m in CONV] + ["Paris is the capital.", "<|user|>\nhi\n<|assistant|>\nParis"]
    sp.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                           initial_alphabet=list(string.printable) + ["▁"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tok.chat_template = ("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + eos_token + '\\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    full = tok.apply_chat_template(CONV, tokenize=False)
    assert ids == tok(full, add_special_tokens=False)["input_ids"]  # the render's tokens, as an engine makes them
    assert [tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m][0] != "▁I"
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.</s>\n", "2+2 equals 4.</s>\n"]


def test_a_prefix_the_template_refuses_leaves_only_that_turn_untrained(tokenizer):
    """QwQ-style templates raise when no user turn is found: rendering an opening greeting alone failed, and the
    whole conversation was counted as one the template refuses."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% if not messages | selectattr('role', 'equalto', 'user') | list %}"
                         "{{ raise_exception('No user query found in messages.') }}{% endif %}" + tokenizer.chat_template)
    conv = [{"role": "assistant", "content": "Hello! How can I help?"}] + CONV
    ids, mask, info = masks.tokenize_conversation(tok, conv, 4096)
    assert info["unaligned"] == 1
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|im_end|>\n", "2+2 equals 4.<|im_end|>\n"]


def test_an_answer_opening_with_the_generation_prompt_s_first_characters_is_trained_whole(tokenizer):
    # R1's prompt ends "<think>\n": the answer "<b>..." shared its "<" with it, and lost its first token
    tok = templated(tokenizer, R1, ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>"])
    conv = [CONV[0], {"role": "assistant", "content": "<b>bold</b> reply"}, CONV[2],
            {"role": "assistant", "content": "<tool>x"}]
    ids, mask, _ = masks.tokenize_conversation(tok, conv, 4096)
    assert masked_spans(tok, ids, mask) == ["<b>bold</b> reply<｜end▁of▁sentence｜>", "<tool>x<｜end▁of▁sentence｜>"]


def test_a_tokenizer_without_offsets_never_cuts_a_marker():
    """A Python tokenizer (no character offsets) with Phi-3's template: the answer's end ran on into the "<|" of the
    next "<|user|>", which was then split and trained."""
    from transformers import PreTrainedTokenizer

    class CharTokenizer(PreTrainedTokenizer):  # one token a character; added tokens matched whole
        def __init__(self, **kw):
            self._chars = [chr(i) for i in range(32, 127)] + ["\n"]  # ids 0-95; added tokens take the next ones
            self._ids = {c: i for i, c in enumerate(self._chars)}
            super().__init__(**kw)

        vocab_size = property(lambda self: len(self._chars))
        get_vocab = lambda self: dict(self._ids, **self.added_tokens_encoder)  # noqa: E731
        _tokenize = lambda self, text: list(text)  # noqa: E731
        _convert_token_to_id = lambda self, t: self._ids.get(t, 0)  # noqa: E731
        _convert_id_to_token = lambda self, i: self._chars[i] if i < len(self._chars) else "?"  # noqa: E731
        convert_tokens_to_string = lambda self, tokens: "".join(tokens)  # noqa: E731

    tok = CharTokenizer(eos_token="<|endoftext|>", bos_token="<s>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = PHI3
    ids, mask, info = masks.tokenize_conversation(tok, CONV, 4096)
    assert ids == tok(tok.apply_chat_template(CONV, tokenize=False), add_special_tokens=False)["input_ids"]
    assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<|end|>\n",
                                            "2+2 equals 4.<|end|>\n<|endoftext|>"]


def test_a_prompt_is_tokenized_as_the_template_tokenizes_it_and_one_far_too_long_is_refused_by_its_characters(
        tokenizer):
    """prompt_ids renders within the template's time budget and tokenizes after it, as apply_chat_template does;
    a render longer in characters than `at_most` tokens could cover is refused without tokenizing (stage 05's
    dry run took two minutes over a 49 MB prompt, then blamed the template's time limit)."""
    for conv in (CONV[:1], CONV[:3], [{"role": "system", "content": "Be brief."}, CONV[0]]):
        want = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert masks.prompt_ids(tokenizer, conv) == masks.prompt_ids(tokenizer, conv, at_most=8192) == \
            want["input_ids"]
    huge = [{"role": "user", "content": "word " * 400_000}]  # 2 MB: far more than 8,192 tokens' worth
    with pytest.raises(masks.PromptTooLong) as e:
        masks.prompt_ids(tokenizer, huge, at_most=8192)
    assert e.value.least > 8192 and e.value.chars > 2_000_000
    assert str(e.value).startswith("at least ") and "characters" in str(e.value)
    at_limit = [{"role": "user", "content": "word " * 2000}]  # tokens, not characters, decide near the limit
    assert len(masks.prompt_ids(tokenizer, at_limit, at_most=2048)) > 2000


def test_a_record_far_longer_than_max_seq_len_is_tokenized_only_as_far_as_it_matters(tokenizer, monkeypatch):
    """Past 2 x (max_seq_len + 1) x the longest token's characters the render is not tokenized (a 49 MB record took
    144 s whole): the rows, masks and truncation are what the whole render gives."""
    conv = [{"role": "user", "content": "Summarize this log."},
            {"role": "assistant", "content": " ".join(f"line {i}: status ok, {i * 7 % 13} retries" for i in range(3000))},
            {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome."}]
    for max_len in (64, 300):
        cut = masks.tokenize_conversation(tokenizer, conv, max_len)
        with monkeypatch.context() as m:
            m.setattr(masks, "longest_token", lambda tok: 10 ** 9)  # no cut: the whole render tokenized
            whole = masks.tokenize_conversation(tokenizer, conv, max_len)
        assert cut == whole and cut[2]["truncated"] and len(cut[0]) == max_len and sum(cut[1]) > 0


def test_a_dropped_tool_call_is_refused_even_where_the_answer_names_the_tool(tokenizer):
    """The embedded ChatML template renders an answer's text and drops its call. Its name standing in the text must
    not pass for the call: the turn rendered with and without the call is the same, and that is what refuses."""
    conv = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "I will ask get_weather.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    with pytest.raises(masks.ToolCallsNotRendered, match=r"message 1's call to 'get_weather' is not in its render"):
        masks.tokenize_conversation(tokenizer, conv, 4096)
    # without the call, the same conversation trains as chat
    plain = [dict(conv[1], tool_calls=None) if i == 1 else m for i, m in enumerate(conv)]
    plain[1].pop("tool_calls")
    _, mask, info = masks.tokenize_conversation(tokenizer, plain, 4096)
    assert any(mask) and info["unaligned"] == 0


def test_tool_calls_render_where_the_template_puts_them_with_tools_in_every_render(tokenizer):
    """Qwen2.5's tool-use template: the tools are written into the system prompt, so every render a span is found
    from must carry them (a render without them put no answer where the whole conversation has it); a call with text
    trains both; consecutive results share one user turn, context."""
    tok = with_template(tokenizer, "qwen2.5-tools.jinja", [])
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    conv = [{"role": "assistant", "content": "Ask me."},  # an opening answer: found with the tools rendered too
            {"role": "user", "content": "Find a and b."},
            {"role": "assistant", "content": "Looking.", "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"q": "a"}}},
                {"type": "function", "function": {"name": "lookup", "arguments": {"q": "b"}}}]},
            {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"},
            {"role": "assistant", "content": "a is A, b is B."}]
    ids, mask, info = masks.tokenize_conversation(tok, conv, 4096, tools)
    assert info == {"unaligned": 0, "truncated": False, "answered": True, "after_stop": 0}
    assert tok.decode(ids) == tok.apply_chat_template(conv, tools=tools, tokenize=False)
    # stage 05's prompt of such a record: the tools written into it, the answer's header last
    prompt = tok.decode(masks.prompt_ids(tok, conv[1:2], tools=tools))
    assert '<tools>\n{"type": "function", "function": {"name": "lookup"' in prompt
    assert prompt.endswith("<|im_start|>user\nFind a and b.<|im_end|>\n<|im_start|>assistant\n")
    call = '\n<tool_call>\n{{"name": "lookup", "arguments": {{"q": "{}"}}}}\n</tool_call>'
    assert masked_spans(tok, ids, mask) == [
        "Ask me.<|im_end|>\n", "Looking." + call.format("a") + call.format("b") + "<|im_end|>\n",
        "a is A, b is B.<|im_end|>\n"]


def test_deepseek_v3_calls_render_in_the_form_its_template_takes(tokenizer, caplog):
    """DeepSeek-V3's template writes a call only for a turn whose text is null, and joins the arguments to strings:
    vLLM's form (text "", arguments an object) fails on it or drops the call. The call is rendered with null text and
    the arguments as the JSON text the model writes, and trained from the first token after the generation prompt;
    a call with text beside it, which this template cannot write, is ToolCallsNotRendered (the record is left out)."""
    tok = with_template(tokenizer, "deepseek-v3.jinja", [
        "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
        "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
        bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conv = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    ids, mask, info = masks.tokenize_conversation(tok, conv, 4096)
    assert info["unaligned"] == 0
    assert masked_spans(tok, ids, mask) == [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
        '<｜tool▁call▁end｜>', "Sunny.<｜end▁of▁sentence｜>"]
    assert "sunny" in tok.decode(ids) and not any("sunny" in s for s in masked_spans(tok, ids, mask))
    with pytest.raises(masks.ToolCallsNotRendered, match="message 1's call to 'get_weather'"):
        masks.tokenize_conversation(tok, [conv[0], dict(conv[1], content="Let me look."), *conv[2:]], 4096)
    # stage 01: a record whose call the template drops is left out and counted, with one warning naming it; a
    # template that renders no record's call refuses the run
    import argparse
    import collections
    import logging
    from eagle3pipe.prepare import preparation
    from eagle3pipe.base.errors import UsageError
    args = argparse.Namespace(max_seq_len=4096, model_path="m", dataset="d", num_workers=None, regenerate=False)
    text_and_call = [conv[0], dict(conv[1], content="Let me look."), *conv[2:]]
    skipped, log = collections.Counter(), logging.getLogger("stage01-test")
    with caplog.at_level(logging.WARNING, logger="stage01-test"):
        rows, _, _ = preparation.tokenize_rows([("r1", conv, None), ("r2", text_and_call, None)], tok, args,
                                               len(tok), skipped, 2, log)
    assert [r["id"] for r in rows] == ["r1"] and skipped == {"tool_calls_not_rendered": 1}
    assert caplog.messages == ["the chat template drops a tool call of 1 of 2 records that call tools, e.g. record r2: "
                      "message 1's call to 'get_weather' is not in its render: those records are left out"]
    with pytest.raises(UsageError, match=r"--model-path m: its chat template renders no tool call \(1 of the records "
                                         r"call tools; first: record r2: message 1's call"):
        preparation.tokenize_rows([("r2", text_and_call, None)], tok, args, len(tok), collections.Counter(), 1, log)


def test_an_alternating_template_loses_only_the_opening_assistant_turn(tokenizer):
    """Gemma's template refuses a conversation an assistant turn opens (roles must alternate from the user). That turn
    answers nothing: stage 01 leaves it out, counted, and trains the rest of the conversation; a conversation with
    nothing after its opening turns stays refused."""
    from eagle3pipe.chat.tokenize_workers import outcome
    tok = with_template(tokenizer, "gemma3.jinja", ["<start_of_turn>", "<end_of_turn>"])
    opening = {"role": "assistant", "content": "Hello! How can I help you today?"}
    with pytest.raises(masks.TemplateError, match="alternate"):
        masks.tokenize_conversation(tok, [opening] + CONV, 4096)
    for system in ([], [{"role": "system", "content": "Be brief."}]):
        kind, ids, mask, meta = outcome(tok, system + [opening, opening] + CONV, 4096, None)
        assert kind == "ok" and meta["opening_turns_dropped"] == 2, meta
        assert masked_spans(tok, ids, mask) == ["I am a helpful assistant.<end_of_turn>\n",
                                                "2+2 equals 4.<end_of_turn>\n"], masked_spans(tok, ids, mask)
        assert "How can I help" not in tok.decode(ids)
    assert outcome(tok, [CONV[0], CONV[0], CONV[1]], 4096, None)[0] == "error"  # not an opening turn: refused
    assert outcome(tok, [opening], 4096, None)[0] == "error"


def test_a_template_that_marks_no_answer_or_only_answers_is_refused_naming_it(model_path, tmp_path):
    """Fail closed: a chat template under which no conversation has an assistant token to train (the answers are not
    rendered: no render puts them anywhere), or under which every token is an answer (no prompt is rendered), is
    refused in one line naming the template, never trained on an all-zero or all-one mask."""
    import json
    from conftest import model_with_template, run_script
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": CONV}) + "\n" for _ in range(3)))
    for name, template, says in (
            ("blind", "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>{{ m.content }}<|im_end|>"
                      "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}",
             "its chat template renders 6 of 6 assistant turns where no render up to them puts them"),
            ("answers", "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<|im_end|>{% endif %}"
                        "{% endfor %}",
             "its chat template renders the 3 conversations as answer text alone"),
            ("empty", "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role != 'assistant' %}{{ m.content }}"
                      "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                      "{% endif %}",
             "no answer's text reaches a trained token in any of the 3 conversations")):
        model = model_with_template(model_path, tmp_path / name, template)
        p, _ = run_script("01_prepare_dataset.py", "--model-path", str(model), "--dataset", str(data),
                          "--output-dir", str(tmp_path / f"out-{name}"), "--max-seq-len", "256")
        lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr[-2000:]
        assert f"--model-path {model}: " in lines[0] and not (tmp_path / f"out-{name}").exists()


def test_a_template_that_writes_no_unicode_is_a_template_error_not_a_traceback(tokenizer):
    """A template writing a lone surrogate ("\\ud800"): a string no UTF-8 encodes, which the tokenizer took as a
    TypeError (a traceback, found by a held-out probe). It is the template's error, named so; a prompt's is one line."""
    from eagle3pipe.base.errors import UsageError
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ '\\ud800' }}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(masks.TemplateError, match=r"writes text that is not Unicode \(surrogates not allowed: "
                                                   r"\\ud800\)"):
        masks.tokenize_conversation(tok, CONV, 4096)
    with pytest.raises(UsageError, match="writes text that is not Unicode"):
        masks.prompt_ids(tok, CONV[:1])


def test_a_tokenizer_that_refuses_the_text_is_one_line_naming_it(model_path, tmp_path):
    """A WordLevel tokenizer whose vocabulary lacks its own unknown token: the Rust library raises a bare Exception
    on any word it does not know (found by a held-out probe: "error: Exception: ...", exit 1). It is the verifier's
    tokenizer's fault, one line naming it (a panic: R/test_stage01_workers.py)."""
    import json
    from transformers import AutoTokenizer
    d = verifier_files(model_path, tmp_path / "tok")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec.update(model={"type": "WordLevel", "unk_token": "[UNK]",
                       "vocab": {"a": 0, "b": 1, **{t["content"]: t["id"] for t in spec["added_tokens"]}}},
                pre_tokenizer={"type": "Whitespace"}, decoder=None, post_processor=None, normalizer=None)
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(str(d))
    with pytest.raises(masks.TokenizerPanic, match=r"the tokenizer of .* failed: Exception: WordLevel error: Missing "
                                                   r"\[UNK\] token"):
        masks.tokenize_conversation(tok, CONV, 4096)

"""Chat-template rendering and assistant-only loss masks, by render boundaries (never regex on text).

For each assistant turn i the verifier's own template renders
    p = messages[:i] + generation prompt        (what the model sees before it starts answering)
    q = messages[:i+1]                          (the same, with the answer and the end-of-turn)
and the text between len(p) and len(q) is the assistant's: content plus the template's end-of-turn tokens.
Both must be prefixes of the full render; a turn whose renders are not (templates that rewrite history,
e.g. dropping earlier reasoning) is left untrained and counted, never guessed.

The full text is tokenized segment by segment (context | answer | context | answer ...), so every mask
boundary is a token boundary and an answer is tokenized on its own, as the verifier would have generated it.
"""
import os

from .deadlines import TemplateTimeout, template_seconds, time_budget
from .errors import UsageError


class TemplateError(Exception):
    """The template refused a conversation (e.g. roles must alternate)."""


class TemplateTooSlow(UsageError):
    """A render ran past its time budget: the template loops (a bug, or hostile); no conversation is worth the wait."""


def _budgeted(tok, fn, *args, **kwargs):
    """fn(*args, **kwargs) within the template's time budget, or one line naming the template."""
    seconds = template_seconds()
    try:
        with time_budget(seconds):
            return fn(*args, **kwargs)
    except TemplateTimeout:
        raise TemplateTooSlow(f"the chat template of {getattr(tok, 'name_or_path', '') or 'the tokenizer'} did not "
                              f"finish one render within {seconds:g} s (a loop in the template?); fix the template "
                              f"(EAGLE3_TEMPLATE_TIMEOUT_S moves the limit)")


def load_tokenizer(model_path, trust_remote_code=False):
    from transformers import AutoTokenizer
    from .deadlines import call, hub_seconds
    try:
        if os.path.isdir(model_path):
            tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        else:  # a hub id: its files may still have to come over the network
            tok = call(AutoTokenizer.from_pretrained, hub_seconds(), f"--model-path {model_path}: the tokenizer from "
                       f"the hub", model_path, trust_remote_code=trust_remote_code)
    except UsageError:
        raise
    except Exception as e:
        # transformers refuses custom code without the opt-in in a multi-line message: say it in one line
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise UsageError(f"--model-path {model_path}: the tokenizer ships its own code, which runs only with "
                             f"--trust-remote-code; rerun with that flag if you trust that code")
        if isinstance(e, (OSError, ImportError)) and not os.path.isdir(model_path):
            raise  # the hub's or the network's failure: its own one line (cli.run)
        # the tokenizer's own code (or its files) failed as it loaded: the verifier's fault, not a run's
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"--model-path {model_path}: its tokenizer failed to load: {type(e).__name__}: {cause}")
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--model-path {model_path}: the tokenizer has no chat template")
    return tok


def render(tok, messages, generation_prompt):
    try:
        return _budgeted(tok, tok.apply_chat_template, messages, tokenize=False,
                         add_generation_prompt=generation_prompt)
    except UsageError:
        raise
    except Exception as e:  # jinja2's raise_exception() and template bugs alike
        raise TemplateError(str(e).splitlines()[0] if str(e) else type(e).__name__)


def probe_template(tok, records):
    """Render the first record (rid, messages) once, within the time budget: one line naming the template and the
    record if it loops. A template that refuses the record is the loop's business (counted there), not a refusal."""
    for rid, messages in records[:1]:
        try:
            assistant_spans(tok, messages)
        except TemplateTooSlow as e:
            raise UsageError(f"record {rid}: {e}")
        except TemplateError:
            pass


def prompt_ids(tok, messages):
    """The token ids of `messages` rendered with the generation prompt (what the verifier answers), within the
    template's time budget."""
    return _budgeted(tok, tok.apply_chat_template, messages, add_generation_prompt=True, tokenize=True,
                     return_dict=True)["input_ids"]


def assistant_spans(tok, messages):
    """(full text, [(start, end) character spans of trained assistant text], number of unaligned turns)."""
    full = render(tok, messages, False)
    spans, unaligned, pos = [], 0, 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        q = render(tok, messages[: i + 1], False)
        if i:
            p = render(tok, messages[:i], True)
        else:  # a conversation opening with the assistant has no prompt to render: its answer starts where
            # the render of an empty answer stops agreeing with q (after any injected system prompt)
            e = render(tok, [{"role": "assistant", "content": ""}], False)
            p = q[: len(os.path.commonprefix([e, q]))]
        if q.startswith(p) and full.startswith(q) and len(p) >= pos and len(q) > len(p):
            spans.append((len(p), len(q)))
            pos = len(q)
        else:
            unaligned += 1
    return full, spans, unaligned


def tokenize_conversation(tok, messages, max_seq_len):
    """-> (input_ids, loss_mask, info). Truncated to max_seq_len; info has 'unaligned' and 'truncated'."""
    full, spans, unaligned = assistant_spans(tok, messages)
    ids, mask, pos = [], [], 0
    pieces = []
    for start, end in spans:
        pieces += [(full[pos:start], 0), (full[start:end], 1)]
        pos = end
    pieces.append((full[pos:], 0))
    for text, m in pieces:
        if not text:
            continue
        # add_special_tokens=False: the template already wrote BOS and friends into the text
        # (transformers' apply_chat_template(tokenize=True) does the same).
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [m] * len(t)
        if len(ids) > max_seq_len:
            break  # the rest would be cut anyway
    info = {"unaligned": unaligned, "truncated": len(ids) > max_seq_len}
    return ids[:max_seq_len], mask[:max_seq_len], info

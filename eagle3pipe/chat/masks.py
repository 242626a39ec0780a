"""Chat-template rendering and assistant-only loss masks, by render boundaries (never regex on text).

For each assistant turn i the verifier's own template renders
    p = messages[:i] + generation prompt        (what the model sees before it starts answering)
    q = messages[:i+1]                          (the same, with the answer and the end-of-turn)
and the text between len(p) and len(q) is the assistant's: content plus the template's end-of-turn tokens.
p must be a prefix of the full render, and so must q. Where q is not (a template that closes every render with
extra text, as Phi-3's end-of-text, or renders the last answer otherwise than an earlier one, as Qwen3's empty
thinking block), the answer's end is found where the full render has it: its content's end (a marked copy of the
answer, rendered as an earlier turn) plus the end-of-turn the two renders share. Where p is not (a generation
prompt opening the answer with text, as DeepSeek-R1's "<think>"), the answer starts where p and the full render
part, provided the conversation before it is the full render's. A turn still not found (a template that moves
earlier text, or drops earlier answers) is left untrained and counted, never guessed.

A tool call is part of its assistant turn: the template renders it there, and it is trained as the answer is; the
tool's result is a turn of its own, context. The record's tool definitions go to every render (`tools`). Calls are
rendered in the first form the template takes them in (for_template). A conversation whose call the template drops
(one written for chat alone) raises ToolCallsNotRendered: trained, the draft would learn to end the turn where the
verifier calls the tool.

The full text is tokenized whole, as the verifier's engine tokenizes it; a token is trained when it lies inside an
answer's span.
"""
import json
import os
import weakref

from ..base.deadlines import TemplateTimeout, template_seconds, time_budget, call, hub_seconds
from ..base.errors import UsageError
from ..storage.files import read_json


class TemplateError(Exception):
    """The template refused a conversation (e.g. roles must alternate)."""


class ToolCallsNotRendered(TemplateError):
    """The template renders an assistant turn without a tool call it makes."""


class TokenizerPanic(UsageError):
    """The tokenizer's Rust code panicked (a pre-tokenizer regex past its backtracking limit), or refused the text (a
    WordLevel vocabulary without its unknown token): the verifier's files' fault. pyo3 raises a PanicException, a BaseException no `except Exception` catches, with a traceback of 100
    lines; this is its one line."""


def _panic(e):
    return type(e).__name__ == "PanicException"


def _panic_line(tok, e):
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return TokenizerPanic(f"the tokenizer of {getattr(tok, 'name_or_path', '') or 'the verifier'} panicked: {why}; "
                          f"fix its tokenizer.json (a pre-tokenizer's regex?)")


def _encode(tok, text, **kwargs):
    """tok(text, add_special_tokens=False, **kwargs): the template already wrote BOS and friends into the text
    (transformers' apply_chat_template(tokenize=True) does the same). A panic is one line."""
    try:
        return tok(text, add_special_tokens=False, **kwargs)
    except BaseException as e:
        if _panic(e):
            raise _panic_line(tok, e) from None
        if type(e) is Exception:  # how the Rust tokenizer refuses a text ("WordLevel error: Missing [UNK] token")
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise TokenizerPanic(f"the tokenizer of {getattr(tok, 'name_or_path', '') or 'the verifier'} failed: "
                                 f"{type(e).__name__}: {why}; fix its tokenizer.json") from None
        raise


class TemplateTooSlow(UsageError):
    """A render ran past its time budget: the template loops (a bug, or hostile); no conversation is worth the wait."""


def too_slow(tok, seconds):
    return TemplateTooSlow(f"the chat template of {getattr(tok, 'name_or_path', '') or 'the tokenizer'} did not "
                           f"finish one render within {seconds:g} s (a loop, or one huge expression, in the template?); fix the template "
                           f"(EAGLE3_TEMPLATE_TIMEOUT_S moves the limit)")


def _budgeted(tok, fn, *args, **kwargs):
    """fn(*args, **kwargs) within the template's time budget, or one line naming the template."""
    seconds = template_seconds()
    try:
        with time_budget(seconds):
            return fn(*args, **kwargs)
    except TemplateTimeout:
        raise too_slow(tok, seconds) from None


def _cause(e):
    """An exception's message in one line: its first line, and the next where the first ends in a colon."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _check_config(model_path, trust_remote_code):
    """config.json as transformers reads it, before the tokenizer (which reads it too, and whose failure would
    otherwise be blamed for it): a field of the wrong type or value is one line naming config.json."""
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (UsageError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the family's config class raises
        if "trust_remote_code" in str(e):
            return  # the tokenizer's own line says it
        raise UsageError(f"--model-path {model_path}: config.json: transformers cannot read it: "
                         f"{type(e).__name__}: {_cause(e)}") from None


def load_tokenizer(model_path, trust_remote_code=False):
    from transformers import AutoTokenizer
    if os.path.isdir(model_path) and os.path.isfile(os.path.join(model_path, "config.json")):
        _check_config(model_path, trust_remote_code)
    try:
        if os.path.isdir(model_path):
            tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        else:  # a hub id: its files may still have to come over the network
            tok = call(AutoTokenizer.from_pretrained, hub_seconds(), f"--model-path {model_path}: the tokenizer from "
                       f"the hub", model_path, trust_remote_code=trust_remote_code)
    except (UsageError, MemoryError):  # out of memory (`ulimit -v`) is this machine's, not the verifier's fault
        raise
    except BaseException as e:
        if not isinstance(e, Exception) and not _panic(e):
            raise  # KeyboardInterrupt, SystemExit
        if _panic(e):
            raise UsageError(f"--model-path {model_path}: {_panic_line(None, e)}") from None
        # transformers refuses custom code without the opt-in in a multi-line message: say it in one line
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise UsageError(f"--model-path {model_path}: the tokenizer ships its own code, which runs only with "
                             f"--trust-remote-code; rerun with that flag if you trust that code")
        if isinstance(e, (OSError, ImportError)) and not os.path.isdir(model_path):
            raise  # the hub's or the network's failure: its own one line (cli.run)
        # the tokenizer's own code (or its files) failed as it loaded: the verifier's fault, not a run's
        raise UsageError(f"--model-path {model_path}: its tokenizer failed to load: {type(e).__name__}: {_cause(e)}")
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--model-path {model_path}: the tokenizer has no chat template")
    _check_deterministic(tok, model_path)
    return tok


def _check_deterministic(tok, model_path):
    """A tokenizer that samples its merges (BPE dropout, SentencePiece's sampling) splits the same text differently
    on every call: the rows would hold splits the verifier's engine never makes, and no two runs would agree."""
    model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
    dropout = getattr(model, "dropout", None)
    if dropout:
        raise UsageError(f"--model-path {model_path}: its tokenizer.json sets BPE dropout {dropout:.3g}: it splits "
                         f"text at random, unlike the verifier's engine at inference; set the model's \"dropout\" "
                         f"to null")
    if (getattr(tok, "sp_model_kwargs", None) or {}).get("enable_sampling"):
        raise UsageError(f"--model-path {model_path}: its tokenizer samples its SentencePiece splits "
                         f"(sp_model_kwargs enable_sampling): it splits text at random; drop that setting")


def render(tok, messages, generation_prompt, tools=None):
    try:
        text = _budgeted(tok, tok.apply_chat_template, messages, tools=tools, tokenize=False,
                         add_generation_prompt=generation_prompt)
    except UsageError:
        raise
    except Exception as e:  # jinja2's raise_exception() and template bugs alike
        raise TemplateError(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _unicode(text)


def _unicode(text):
    """The render, if it is text a tokenizer takes: a template that writes a lone surrogate ("\\ud800") makes a
    string no UTF-8 encodes (the tokenizer's TypeError, a traceback, otherwise)."""
    if not isinstance(text, str):
        raise TemplateError(f"the template rendered a {type(text).__name__}, not text")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TemplateError(f"the template writes text that is not Unicode ({e.reason}: "
                                f"{text[e.start:e.end].encode('unicode_escape').decode()[:20]})") from None
    return text


class PromptTooLong(Exception):
    """A render too long, by its characters alone, for the tokens allowed: `least` tokens at the fewest."""

    def __init__(self, least, chars):
        super().__init__(f"at least {least:,} tokens ({chars:,} characters)")
        self.least, self.chars = least, chars


_longest_token = weakref.WeakKeyDictionary()  # tokenizer -> the most characters one token of its vocabulary covers


def longest_token(tok):
    if tok not in _longest_token:
        _longest_token[tok] = max((len(t) for t in tok.get_vocab()), default=1) or 1
    return _longest_token[tok]


def prompt_ids(tok, messages, at_most=None, tools=None):
    """The token ids of `messages` rendered with the generation prompt (what the verifier answers), tokenized as
    apply_chat_template tokenizes (no special tokens added). The render runs within the template's time budget, the
    tokenizing after it: a long prompt's tokenizing is not the template's fault. `at_most`: a render longer than
    `at_most` tokens could be, by its characters alone (each token stands for at most longest_token characters;
    twice that, for a normalizer's sake), raises PromptTooLong without tokenizing: a 49 MB prompt took two minutes.
    `tools`: the record's tool definitions, which the template writes into the prompt."""
    text = _budgeted(tok, tok.apply_chat_template, messages, tools=tools, add_generation_prompt=True, tokenize=False)
    try:
        text = _unicode(text)
    except TemplateError as e:
        raise UsageError(f"the chat template of {getattr(tok, 'name_or_path', '') or 'the tokenizer'}: {e}") from None
    if at_most is not None and len(text) > 2 * at_most * longest_token(tok):
        raise PromptTooLong(len(text) // (2 * longest_token(tok)), len(text))
    return _encode(tok, text)["input_ids"]


def prompt_outcome(tok, at_most, item):
    """prompt_ids of one (messages, tools) as a worker hands it back (tokenize_workers.mapped): ("ok", ids), ("long",
    why), ("slow", why) or ("panic", why)."""
    messages, tools = item
    try:
        return ("ok", prompt_ids(tok, messages, at_most, tools))
    except PromptTooLong as e:
        return ("long", str(e))
    except TemplateTooSlow as e:
        return ("slow", str(e))
    except TokenizerPanic as e:
        return ("panic", str(e))


MARK = "\u2063"  # appended to an answer to find where its text ends in a render: no template trims or parses it


def _common(a, b):
    """The length of the common beginning of two strings, by halving over slices: their comparisons run in C, where
    a loop over characters (os.path.commonprefix) made long conversations quadratic in Python."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _token_end(tok, text, n):
    """The last token boundary of `text` at or before character n (where a marker follows: characters alone run on
    into its first ones, "<" of "<|user|>" and of "<|endoftext|>"). Without offsets, an added token's text that n
    cuts into is left whole."""
    if not n:
        return 0
    whole = _offsets(tok, text[: n + 256])  # a token past n + 256 cannot end before n
    if whole is not None:
        return max((e for _, e in whole[1] if e <= n), default=0)
    markers, moved = [m for m in getattr(tok, "get_added_vocab", dict)() if len(m) > 1], True
    while moved:  # stepping back before one marker may cut into another
        moved = False
        for marker in markers:
            at = text.find(marker, max(0, n - len(marker) + 1), n + len(marker) - 1)  # one across n, if any
            if 0 <= at < n:
                n, moved = at, True
    return n


def _shared_head(tok, a, b):
    """The length of the longest common beginning of `a` and `b` that ends at a token boundary of `a`."""
    return _token_end(tok, a, _common(a, b))


def _answer_start(tok, messages, i, full, tools=None):
    """Where assistant turn i's text starts in `full` (characters), or None when what the verifier answers from is
    not what `full` holds before it (a template that moves earlier text, e.g. a system prompt onto the last turn)."""
    if not i:  # no prompt to render: the answer starts where the renders of two different answers part
        a, b = (render(tok, [{"role": "assistant", "content": x}], False, tools) for x in "AB")
        k = _common(a, b)
        return k if full.startswith(a[:k]) else None
    p = render(tok, messages[:i], True, tools)
    if full.startswith(p):
        return len(p)
    # a generation prompt that opens the answer with text its rendered answer lacks (DeepSeek-R1's "<think>\n"): the
    # conversation so far must still be full's; the answer starts where p and full part, or before, where two
    # different answers part (an answer opening with the prompt's own first characters, "<" of "<think>")
    k = _common(render(tok, messages[:i], False, tools), p)
    if not full.startswith(p[:k]):
        return None
    a, b = (render(tok, messages[:i] + [dict(messages[i], content=x)], False, tools) for x in "AB")
    ab = _common(a, b)
    start = _common(p, full)
    if start < ab:
        # p and full part before the answer does: the turn's own header is not the prompt's (a turn number, another
        # role name). What lies between is the template's text, not the verifier's answer: not trained
        return None
    return ab if k <= ab < start and full.startswith(a[:ab]) else start


def _answer_end(tok, messages, i, full, start, tools=None):
    """Where assistant turn i's text (its content, any tool call, and the template's end-of-turn) ends in `full`, or
    None."""
    q = render(tok, messages[: i + 1], False, tools)
    if full.startswith(q) and len(q) > start:
        return len(q)
    # the turn ends otherwise as the last of a render than as an earlier one: a template that closes a render with
    # extra text (Phi-3's end-of-text), or renders the last answer otherwise (Qwen3's empty thinking block). Find the
    # content's end in both renders with a marked copy of the answer; the end-of-turn is what follows it in both.
    marked = messages[:i] + [dict(messages[i], content=(messages[i]["content"] or "") + MARK)]
    after = [{"role": "user", "content": "A"}]
    try:
        h, h2 = render(tok, messages[: i + 1] + after, False, tools), render(tok, marked + after, False, tools)
        q2 = render(tok, marked, False, tools)
    except TemplateError:
        return None
    c, cq = _common(h, h2), _common(q, q2)
    if c >= min(len(h), len(h2)) or cq >= min(len(q), len(q2)):
        return None  # the template does not render this answer
    end = c + _shared_head(tok, q[cq:], h[c:])
    return end if end > start and full.startswith(h[:end]) else None


def _turn_with_calls(message, k):
    """An assistant message with its first k tool calls (none: no call, its null text as "")."""
    m = {key: v for key, v in message.items() if key != "tool_calls"}
    if k:
        m["tool_calls"] = message["tool_calls"][:k]
    elif m["content"] is None:
        m["content"] = ""
    return m


def _check_calls_rendered(tok, messages, i, tools):
    """Each of turn i's tool calls must change its render: a template written for chat alone renders the answer's
    text and drops the call (and gpt-oss's renders a turn's first call alone). The render is compared, not searched
    for the call's name: Kimi's templates write the call's id in its place."""
    calls = messages[i].get("tool_calls")
    if not calls:
        return
    try:
        before = render(tok, messages[:i] + [_turn_with_calls(messages[i], 0)], False, tools)
        for k, tool_call in enumerate(calls, 1):
            now = render(tok, messages[:i] + [_turn_with_calls(messages[i], k)], False, tools)
            if now == before:
                raise ToolCallsNotRendered(f"message {i}'s call to {tool_call['function']['name']!r} is not in its "
                                           f"render")
            before = now
    except ToolCallsNotRendered:
        raise
    except TemplateError:  # a template that refuses part of the calls (Llama 3.1: one a turn) rendered them all
        pass


def _call_forms(messages):
    """The conversation in each form chat templates take tool calls in, vLLM's first: arguments as objects and a
    call alone with "" as its text; then arguments as the JSON text these models write (DeepSeek's templates join
    them to strings and fail on objects), and a call alone with null text (DeepSeek-V3's and R1's render a call
    only then)."""
    def form(text_args, null_text):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = dict(m)
                if text_args:
                    m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.dumps(
                        c["function"]["arguments"], ensure_ascii=False))) for c in m["tool_calls"]]
                if null_text and not m["content"]:
                    m["content"] = None
            out.append(m)
        return out
    return [messages] + [form(a, n) for a, n in ((True, False), (False, True), (True, True))]


def for_template(tok, messages, tools=None):
    """(`messages` in the first form (_call_forms) the template renders whole with its first tool call in it, that
    render). As given where it calls no tool, or where no form does (the caller's checks then say why)."""
    first = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
    if first is not None:
        for form in _call_forms(messages):
            try:
                full = render(tok, form, False, tools)
                _check_calls_rendered(tok, form, first, tools)
            except TemplateError:  # ToolCallsNotRendered included
                continue
            return form, full
    return messages, render(tok, messages, False, tools)


def assistant_spans(tok, messages, full=None, limit=None, tools=None):
    """(full text, [(start, end) character spans of trained assistant text], number of unaligned turns). `limit`:
    the character where the row is cut (--max-seq-len): turns after it are not looked for. `tools`: the record's
    tool definitions, given to every render. A tool call the template does not render raises ToolCallsNotRendered."""
    if full is None:
        messages, full = for_template(tok, messages, tools)
    spans, unaligned, pos = [], 0, 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if limit is not None and pos >= limit:
            break
        try:  # only the whole render may refuse a conversation: a prefix a template refuses (a check for a user
            # turn, say) leaves that turn untrained
            start = _answer_start(tok, messages, i, full, tools)
            end = _answer_end(tok, messages, i, full, start, tools) if start is not None and start >= pos else None
        except TemplateError:
            end = None
        if end is None:
            unaligned += 1
            continue
        _check_calls_rendered(tok, messages, i, tools)
        spans.append((start, end))
        pos = end
    return full, spans, unaligned


def _offsets(tok, text):
    """(ids, [(start, end) characters of each token]) of `text` tokenized whole, or None where the tokenizer keeps
    no offsets (a Python tokenizer, a custom one)."""
    try:
        enc = _encode(tok, text, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        return None
    return (ids, offsets) if len(ids) == len(offsets) else None


def tokenize_conversation(tok, messages, max_seq_len, tools=None):
    """-> (input_ids, loss_mask, info). Truncated to max_seq_len; info has 'unaligned' and 'truncated'. `tools`: the
    record's tool definitions (the template writes them into the prompt).

    The whole render is tokenized at once, as the verifier's engine tokenizes a prompt, and a token is trained when
    it lies wholly inside an answer's span (one that straddles a boundary is context). Segment by segment would give
    each segment a tokenizer's start-of-text treatment: SentencePiece-style tokenizers (Llama-2, Mistral) prepend a
    space to each, tokens the verifier never generates. A tokenizer without offsets is tokenized by segment."""
    messages, full = for_template(tok, messages, tools)
    # a render far longer than max_seq_len tokens could cover is tokenized only that far (a 49 MB record took 144 s
    # whole): the cut lies at least max_seq_len + 1 tokens past the last token kept, where it changes none of them
    cap = 2 * (max_seq_len + 1) * longest_token(tok)
    whole = _offsets(tok, full[:cap] if len(full) > cap else full)
    limit = whole[1][max_seq_len][0] if whole is not None and len(whole[0]) > max_seq_len else None
    full, spans, unaligned = assistant_spans(tok, messages, full, limit, tools)
    ids, mask, which = [], [], []  # which: the span each trained token lies in (-1: none)
    if whole is not None:
        ids, k = whole[0], 0
        for a, b in whole[1]:  # offsets ascend: one pass over the spans
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            mask.append(int(k < len(spans) and spans[k][0] <= a and b <= spans[k][1]))
            which.append(k if mask[-1] else -1)
    else:
        pieces, pos = [], 0
        for k, (start, end) in enumerate(spans):
            pieces += [(full[pos:start], 0, -1), (full[start:end], 1, k)]
            pos = end
        pieces.append((full[pos:], 0, -1))
        for text, m, k in pieces:
            if not text:
                continue
            t = _encode(tok, text)["input_ids"]
            ids += t
            mask += [m] * len(t)
            which += [k] * len(t)
            if len(ids) > max_seq_len:
                break  # the rest would be cut anyway
    offsets = whole and whole[1]
    after_stop = _untrain_after_stop(tok, full, ids, mask, offsets, which)
    info = {"unaligned": unaligned, "truncated": len(ids) > max_seq_len,
            "answered": _answered(tok, full, ids[:max_seq_len], mask, offsets), "after_stop": after_stop}
    return ids[:max_seq_len], mask[:max_seq_len], info


_stops = weakref.WeakKeyDictionary()  # tokenizer -> the token ids its verifier stops generating at


def stop_ids(tok):
    """The ids the verifier's generation ends at: the tokenizer's end of text and generation_config.json's
    eos_token_id (one or a list), as vLLM stops."""
    if tok not in _stops:
        ids = {tok.eos_token_id} if isinstance(tok.eos_token_id, int) else set()
        path = os.path.join(getattr(tok, "name_or_path", "") or "", "generation_config.json")
        if os.path.isfile(path):
            try:
                eos = read_json(path).get("eos_token_id")
            except (UsageError, AttributeError):
                eos = None
            ids |= {e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)}
        _stops[tok] = frozenset(ids)
    return _stops[tok]


def _untrain_after_stop(tok, full, ids, mask, offsets, which):
    """Within each trained run, what follows a stop token is never generated: vLLM ends the answer there. Text a
    template closes the last render with (Phi-3's end of text after its end of turn), a turn it appends after the
    answer, an answer that itself holds the end-of-turn marker: untrained (in place) from the stop token on. Blank
    text after it (ChatML's newline after <|im_end|>) stays as the turn's close. -> how many tokens were untrained."""
    stops, cut, k, n = stop_ids(tok), 0, 0, min(len(ids), len(mask))
    if not stops:
        return 0
    while k < n:
        if not (mask[k] and ids[k] in stops):
            k += 1
            continue
        end = k + 1  # the rest of this answer's span (the next answer's span may follow at once)
        while end < n and mask[end] and which[end] == which[k]:
            end += 1
        rest = range(k + 1, end)
        text = "".join(full[offsets[j][0]:offsets[j][1]] if offsets else tok.decode([ids[j]]) for j in rest)
        if text.strip():
            for j in rest:
                mask[j] = 0
            cut += len(rest)
        k = end
    return cut


def _answered(tok, full, ids, mask, offsets):
    """Whether a trained token carries answer text: one that is not blank and not a marker (special or added). A
    template that renders an answer empty, a vocabulary that has no token for its text, a normalizer that erases it:
    each leaves an end-of-turn marker alone trained, which would teach the draft nothing but where turns end."""
    markers = None
    for k, (t, m) in enumerate(zip(ids, mask)):
        if not m:
            continue
        text = full[offsets[k][0]:offsets[k][1]] if offsets else tok.decode([t])
        if not text.strip():
            continue
        if markers is None:
            markers = set(tok.all_special_ids) | set(getattr(tok, "get_added_vocab", dict)().values())
        if t not in markers:
            return True
    return False

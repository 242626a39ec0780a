"""The engines stage 01 --regenerate asks for the verifier's answers, as objects picked in one place (`pick`):
vLLM (the serving engine: its own batching, tensor parallel) and transformers (for a training cluster without the
serving engine: batched by length on a GPU or this CPU). Both take token-id prompts and give each one's text as vLLM
hands it back (detokenized without special tokens, ended before the stop token), greedy at temperature 0.

`--regen-engine auto` takes vLLM where it is installed, else transformers."""
import importlib.util
import logging

from ..base.errors import UsageError
from ..chat.masks import stop_ids
from ..engines import engine
from ..verifier.verifier_weights import check_loaded

log = logging.getLogger("eagle3")


def pick(name):
    """--regen-engine -> the engine class (auto: vLLM where installed)."""
    if name == "auto":
        name = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return {"vllm": VllmAnswers, "hf": HFAnswers}[name]


class VllmAnswers:
    name = "vllm"
    tensor_parallel = True
    keeps_quantized = True  # quantized weights run on vLLM's kernels for them
    caps_batch = True  # its max_num_batched_tokens bounds --regen-batch-size (regenerate.check)
    by_length = False  # it schedules the prompts itself

    def __init__(self, args, tok, on_gpu, dtype, log_path):
        self.on_gpu = on_gpu
        self.llm = engine.make_llm(args.model_path, tp=args.regen_tp_size, max_model_len=args.max_seq_len,
                                   on_gpu=on_gpu, trust_remote_code=args.trust_remote_code, seed=args.seed,
                                   max_num_seqs=args.regen_batch_size, dtype=dtype, log_path=log_path)

    def answers(self, prompts, limits, temperature, seeds):
        """[token ids] with each one's most new tokens and sampling seed -> [text]."""
        from vllm import SamplingParams  # after make_llm: importing vLLM prints, and the engine's log takes it
        # a seed per conversation and turn makes a sampled answer independent of its batch, but vLLM rewinds that
        # generator after a chunked prefill, which CPU generators cannot do (the engine dies: "CPU Generator does not
        # use offset"); on CPU the engine's seed alone drives the sampling
        params = [SamplingParams(temperature=temperature, seed=s if self.on_gpu else None, max_tokens=n)
                  for n, s in zip(limits, seeds)]
        outs = engine.generate(self.llm, [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]


class HFAnswers:
    """transformers' generate on the verifier, a batch at a time, prompts left-padded (longest first, so a batch's
    prompts are alike in length). Its weights are checked as stage 02's HF backend checks them: none filled at
    random. Sampled answers depend on the batch they fall in (one generator a batch, seeded by its first prompt)."""
    name = "hf"
    tensor_parallel = False
    keeps_quantized = False  # transformers loads them through its quantizer (its environment check first)
    caps_batch = False
    by_length = True  # a batch of alike lengths pads least: the caller hands them longest first

    def __init__(self, args, tok, on_gpu, dtype, log_path):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
        transformers.utils.logging.disable_progress_bar()
        self.torch, self.tok, self.GenerationConfig = torch, tok, GenerationConfig
        self.device = "cuda" if on_gpu else "cpu"
        self.model, info = AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=getattr(torch, dtype), trust_remote_code=args.trust_remote_code,
            output_loading_info=True, device_map={"": self.device})
        check_loaded(info, args.model_path)
        self.model.eval()
        self.stops = sorted(stop_ids(tok))
        if not self.stops:
            raise UsageError(f"--model-path {args.model_path}: the verifier names no token its answers end at (no "
                             f"eos_token in its tokenizer or generation_config.json): --regenerate would write to "
                             f"--regen-max-tokens every time")
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.stops[0]

    def answers(self, prompts, limits, temperature, seeds):
        torch = self.torch
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        width = len(prompts[order[0]])
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, i in enumerate(order):  # left-padded: every prompt ends where generation starts
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        sample = temperature > 0
        if sample:
            torch.manual_seed(seeds[order[0]])
        # the whole configuration given: the model's generation_config.json (a repetition penalty, top-k 50) would
        # otherwise apply, which vLLM's explicit sampling parameters leave out
        config = self.GenerationConfig(max_new_tokens=max(limits), do_sample=sample, num_beams=1,
                                       temperature=temperature if sample else 1.0, top_k=0, top_p=1.0,
                                       eos_token_id=self.stops, pad_token_id=self.pad)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
        texts = [""] * len(prompts)
        for row, i in enumerate(order):
            new = out[row, width:].tolist()[:limits[i]]
            end = next((k for k, t in enumerate(new) if t in self.stops), len(new))  # vLLM's text ends before it
            texts[i] = self.tok.decode(new[:end], skip_special_tokens=True)
        return texts

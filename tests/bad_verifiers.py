"""Bad verifier folders for the weights check (eagle3pipe/verifier/verifier_weights.py), generated from a real saved verifier
with one thing wrong each: a tensor dropped, one added, one transposed, reshaped or retyped, a shard gone, the index
naming the wrong file or a file that is not there, a header whose offsets overlap, only the embeddings and the final
norm left, and what two loaders would read differently (a tensor in two shards, a stray file beside the whole one,
the whole file beside an index). Which tensor each fault takes is drawn with a fixed seed per family, so a failure reproduces, and the
cases are generated from whatever the family's checkpoint holds, not listed."""
import json
import os
import random
import shutil

from bad_drafts import header_and_data, read_st, write_st

SEED = 64
INDEX = "model.safetensors.index.json"


def tensors_of(folder):
    """{name: [dtype, shape, bytes]} of a saved verifier (one file or an index's shards)."""
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return read_st(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, INDEX)) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for shard in shards:
        out.update(read_st(os.path.join(folder, shard)))
    return out


def _copy_beside(src, out):
    """`src`'s files but its weights in `out` (config, tokenizer, code)."""
    os.makedirs(out)
    for name in os.listdir(src):
        if not (name.endswith(".safetensors") or name == INDEX):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))


def write_sharded(out, tensors, shards=2, index=None):
    """`tensors` over `shards` files with an index (`index(weight_map)` may edit it). -> {name: file}"""
    names = sorted(tensors)
    wmap = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_st(os.path.join(out, fname), {k: tensors[k] for k in part})
        wmap.update({k: fname for k in part})
    shown = dict(wmap)
    if index:
        index(shown)
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": shown}, f)
    return wmap


def _floats(tensors):
    """The plain floating-point weights (a packed Linear's scales are checked by quantization.py, not here)."""
    return sorted(k for k, v in tensors.items() if v[0] in ("BF16", "F16", "F32")
                  and not k.endswith(("weight_scale", "weight_zero_point")))


def cases(tensors, rng, packed=False):
    """-> [(name, make(out), the words its refusal must hold)] for one family's tensors; `packed`: its config says
    pack-quantized (a checkpoint with no packed tensor left is refused as that first)."""
    names = sorted(tensors)
    gone = rng.choice(names)
    mats = [k for k in _floats(tensors) if len(tensors[k][1]) == 2 and tensors[k][1][0] != tensors[k][1][1]]
    turned = rng.choice(mats)
    vec = rng.choice([k for k in _floats(tensors) if len(tensors[k][1]) == 1])
    float_name = rng.choice(_floats(tensors))
    layer = rng.choice(sorted({k.split("layers.")[1].split(".")[0] for k in names if "layers." in k}))
    junk = rng.choice([f"model.layers.{layer}.extra_proj.weight", "vision_tower.patch_embed.weight", "junk"])
    keep = [k for k in names if k.endswith(("embed_tokens.weight", "model.norm.weight"))]

    def single(change):
        def make(out):
            t = {k: list(v) for k, v in tensors.items()}
            change(t)
            write_st(os.path.join(out, "model.safetensors"), t)
        return make

    def sharded(edit_index=None, remove=None, lie=None):
        def make(out):
            wmap = write_sharded(out, tensors, index=edit_index)
            if remove:
                os.unlink(os.path.join(out, wmap[remove]))
            if lie:
                fname = wmap[names[0]]
                part = {k: tensors[k] for k, f in wmap.items() if f == fname}
                header, data = header_and_data(part, lie)
                raw = json.dumps(header).encode()
                with open(os.path.join(out, fname), "wb") as f:
                    f.write(len(raw).to_bytes(8, "little") + raw + data)
        return make

    def twice(out):  # `gone` also written into the other shard: two copies, the index naming one
        wmap = write_sharded(out, tensors)
        other = next(f for f in sorted(set(wmap.values())) if f != wmap[gone])
        part = {k: tensors[k] for k, f in wmap.items() if f == other}
        write_st(os.path.join(out, other), {**part, gone: tensors[gone]})

    def stray(out):  # the whole file, and a copy of one tensor in another file beside it, no index
        write_st(os.path.join(out, "model.safetensors"), tensors)
        write_st(os.path.join(out, "extra.safetensors"), {gone: tensors[gone]})

    def both(out):  # the whole file and a sharded copy with its index: each loader takes another
        write_sharded(out, tensors)
        write_st(os.path.join(out, "model.safetensors"), tensors)

    def overlap(header):
        keys = [k for k in header if k != "__metadata__"]
        if len(keys) > 1:
            header[keys[1]]["data_offsets"] = [o - 2 for o in header[keys[1]]["data_offsets"]]

    def retype(t):
        dtype, shape, raw = t[float_name]
        t[float_name] = ["I16" if dtype in ("BF16", "F16") else "I32", shape, raw]

    def transpose(t):
        t[turned] = [t[turned][0], t[turned][1][::-1], t[turned][2]]

    def reshape(t):
        dtype, shape, raw = t[vec]
        t[vec] = [dtype, [shape[0] + 1], raw + raw[: len(raw) // shape[0]]]

    return [
        ("dropped", single(lambda t: t.pop(gone)), [gone]),
        ("added", single(lambda t: t.__setitem__(junk, ["BF16", [4, 4], bytes(32)])), [f"tensor {junk} is not part of a "]),
        ("transposed", single(transpose), [f"tensor {turned} is {tensors[turned][1][::-1]}", "(transposed)"]),
        ("reshaped", single(reshape), [f"tensor {vec} is [{tensors[vec][1][0] + 1}]"]),
        ("retyped", single(retype), [f"tensor {float_name} is stored as I"]),
        ("embeddings-only", single(lambda t: [t.pop(k) for k in names if k not in keep]),
         ["but no tensor is packed"] if packed else ["are missing", "a shard missing?"]),
        ("shard-gone", sharded(remove=gone), ["missing (model.safetensors.index.json names it"]),
        ("index-elsewhere", sharded(edit_index=lambda m: m.__setitem__(
            gone, "model-00002-of-00002.safetensors" if m[gone].startswith("model-00001") else
            "model-00001-of-00002.safetensors")), [f"tensor {gone} is not in "]),
        ("index-names-a-stranger", sharded(edit_index=lambda m: m.__setitem__(gone, "model-00009-of-00009.safetensors")),
         ["model-00009-of-00009.safetensors: missing"]),
        ("offsets-overlap", sharded(lie=overlap), ["the header's offsets overlap or leave a gap"]),
        ("in-two-shards", twice, [f"tensor {gone} is also in "]),
        ("stray-beside-whole", stray, ["extra.safetensors: beside model.safetensors with no"]),
        ("whole-and-sharded", both, ["beside model.safetensors: transformers loads model.safetensors, vLLM the "
                                     "index's files"]),
    ]


def build(src, root, family):
    """Every bad folder of one family's verifier `src` under `root`. -> [(case name, folder, needles)]"""
    tensors = tensors_of(src)
    rng = random.Random(f"{SEED}-{family}")
    with open(os.path.join(src, "config.json")) as f:
        packed = "pack-quantized" in f.read()
    out = []
    for name, make, needles in cases(tensors, rng, packed):
        folder = os.path.join(root, f"{family}-{name}")
        _copy_beside(src, folder)
        make(folder)
        out.append((name, folder, needles))
    return out

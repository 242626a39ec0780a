"""Bad draft folders for stage 05's checks, generated from a real stage 04 checkpoint with one thing wrong each
(tests/reliability/test_bad_drafts.py, tests/slow/test_bad_drafts.py): every config field deleted, of the wrong
type, out of range or huge; the weights missing, empty, random bytes, cut short at several offsets, a header lying
about its offsets, a tensor removed, reshaped or retyped, a layer too many, a vocabulary map out of range. Mutations
are drawn with a fixed seed, so a failure reproduces."""
import copy
import json
import os
import random
import shutil
import struct

from conftest import assert_refused, run_script, snapshot

SEED = 32
BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "I64": 8, "F64": 8}
MISSING = object()


# ---- the real checkpoint, as data -------------------------------------------------------------------------------

def read_st(path):
    """{name: [dtype, shape, bytes]} of a safetensors file (the test's own reader: the format is 8 bytes + JSON)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: [v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]]
            for k, v in header.items() if k != "__metadata__"}


def header_and_data(tensors, lie=None):
    """The safetensors header (a dict) and data section for `tensors`; `lie(header)` may edit the header."""
    header, data, at = {"__metadata__": {"format": "pt"}}, bytearray(), 0
    for k in sorted(tensors):
        dtype, shape, raw = tensors[k]
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        data += raw
        at += len(raw)
    if lie:
        lie(header)
    return header, bytes(data)


def write_st(path, tensors, lie=None, length=None):
    header, data = header_and_data(tensors, lie)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def tensor_of(dtype, shape, rng):
    n = 1
    for d in shape:
        n *= d
    return [dtype, shape, rng.randbytes(n * BYTES[dtype])]


def base_of(ckpt):
    """The checkpoint's config and tensors, without embed_tokens (optional: vLLM shares the verifier's), so each
    mutant is a few MB, not 70."""
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    tensors = read_st(os.path.join(ckpt, "model.safetensors"))
    tensors.pop("embed_tokens.weight", None)
    return cfg, tensors


# ---- the mutations ----------------------------------------------------------------------------------------------
# Each: (id, function(cfg, tensors, folder, rng) that edits cfg/tensors in place, or writes the folder itself and
# returns True). Config fields are addressed as "key" or "transformer_layer_config.key".

LAYER = "transformer_layer_config."
REQUIRED = ["speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
            "eagle_aux_hidden_state_layer_ids", "dtype"] + [LAYER + k for k in (
                "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings")]
INTS = ["draft_vocab_size"] + [LAYER + k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                   "num_attention_heads", "intermediate_size",
                                                   "max_position_embeddings", "num_key_value_heads", "head_dim",
                                                   "sliding_window")]
BOOLS = ["norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad",
         "tie_word_embeddings"] + [LAYER + k for k in ("attention_bias", "mlp_bias", "tie_word_embeddings")]


def field(cfg, path):
    *up, key = path.split(".")
    for k in up:
        cfg = cfg[k]
    return cfg, key


def set_field(path, value):
    def mutate(cfg, tensors, folder, rng):
        d, k = field(cfg, path)
        if value is MISSING:
            del d[k]
        else:
            d[k] = value
    return mutate


def config_mutations():
    out = [(f"delete {p}", p, set_field(p, MISSING)) for p in REQUIRED]
    for p in INTS:  # a string and a float where an int belongs; zero; huge
        out += [(f"{p} = {v!r}", p, set_field(p, v)) for v in ("7", 7.5, 0, 10**12)]
    out += [(f"{p} = {v!r}", p, set_field(p, v)) for p, v in [
        ("draft_vocab_size", True), ("draft_vocab_size", -1), (LAYER + "num_hidden_layers", True),
        (LAYER + "num_hidden_layers", -1), (LAYER + "num_key_value_heads", [3]), (LAYER + "vocab_size", None)]]
    out += [(f"{p} = 'yes'", p, set_field(p, "yes")) for p in BOOLS]
    out += [(f"{p} = 1", p, set_field(p, 1)) for p in ("norm_before_fc", LAYER + "attention_bias")]
    ids = "eagle_aux_hidden_state_layer_ids"
    out += [(f"{ids} = {v!r}", ids, set_field(ids, v)) for v in
            ([2, 15, 31], [-1, 15, 27], [2, 15, 10**12], [27, 15, 2], [2, 2, 27], [], "2,15,27", [2.0, 15, 27],
             [True, 15, 27], list(range(10**5)))]
    out += [(f"{p} = {v!r}", p, set_field(p, v)) for p, v in [
        ("speculators_model_type", "eagle"), ("speculators_model_type", 3), ("architectures", "Eagle3DraftModel"),
        ("architectures", []), ("architectures", [7]), ("transformer_layer_config", [576]),
        ("dtype", "int8"), ("dtype", 16), ("target_hidden_size", 4096), ("target_hidden_size", "576"),
        ("draft_vocab_size", 49153), ("speculators_config", "x"),
        (LAYER + "model_type", "mistral"), (LAYER + "model_type", 7), (LAYER + "vocab_size", 49151),
        (LAYER + "hidden_size", 577), (LAYER + "num_hidden_layers", 33), (LAYER + "num_attention_heads", 577),
        (LAYER + "num_key_value_heads", 2), (LAYER + "num_key_value_heads", 10), (LAYER + "rms_norm_eps", 0),
        (LAYER + "rms_norm_eps", "1e-5"), (LAYER + "rms_norm_eps", 2.0), (LAYER + "max_position_embeddings", 10**9),
        (LAYER + "hidden_act", 7), (LAYER + "layer_types", ["sliding_attention"] * 2), (LAYER + "layer_types", "x"),
        (LAYER + "rope_parameters", [1]), (LAYER + "rope_parameters.rope_theta", -1.0),
        (LAYER + "rope_parameters.rope_theta", "1e5"), (LAYER + "rope_parameters.rope_type", "warp"),
        (LAYER + "rope_parameters.factor", 0), (LAYER + "rope_parameters.original_max_position_embeddings", 1.5),
        (LAYER + "dtype", "float8"),
        # each loads in vLLM and then fails: the activation, the layer types, a quantization; an empty class name
        (LAYER + "hidden_act", "gelu"), (LAYER + "hidden_act", "no_such_act"), (LAYER + "hidden_act", MISSING),
        (LAYER + "layer_types", ["bogus_attention"]), ("architectures", [""]),
        ("quantization_config", {"quant_method": "fp8"}),
        (LAYER + "quantization_config", {"quant_method": "awq"}), (LAYER + "bias", True)]]
    for kind, missing in [("yarn", "factor"), ("linear", "factor"), ("dynamic", "factor"), ("llama3", "factor"),
                          ("llama3", "low_freq_factor"), ("llama3", "high_freq_factor")]:
        full = {"rope_type": kind, "rope_theta": 1e5, "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        out.append((f"rope {kind} without {missing}", LAYER + "rope_parameters." + missing, set_field(
            LAYER + "rope_parameters", {k: v for k, v in full.items() if k != missing})))
    # a bias flag without its tensors (the flag alone: build() writes the unchanged weights)
    out += [(f"{p} = true", p, set_field(p, True)) for p in (LAYER + "attention_bias", LAYER + "mlp_bias")]
    return out


def edit_tensors(fn):
    def mutate(cfg, tensors, folder, rng):
        fn(tensors, rng)
    return mutate


def written(fn):
    """A mutation that writes model.safetensors itself: fn(path, tensors, rng)."""
    def mutate(cfg, tensors, folder, rng):
        fn(os.path.join(folder, "model.safetensors"), tensors, rng)
        return True
    return mutate


def cut(at):
    """model.safetensors cut short at `at`(size, header length, rng) bytes."""
    def fn(path, tensors, rng):
        write_st(path, tensors)
        size, n = os.path.getsize(path), struct.unpack("<Q", open(path, "rb").read(8))[0]
        with open(path, "r+b") as f:
            f.truncate(at(size, n, rng))
    return fn


def shift(name, by):
    def lie(header):
        header[name]["data_offsets"][1] += by
    return lie


def weight_mutations():
    d = [
        ("missing", written(lambda p, t, r: None)),
        ("empty", written(lambda p, t, r: open(p, "wb").close())),
        ("a folder", written(lambda p, t, r: os.mkdir(p))),
        ("a FIFO", written(lambda p, t, r: os.mkfifo(p))),
        ("a link to nothing", written(lambda p, t, r: os.symlink(p + ".gone", p))),
        ("7 bytes", written(lambda p, t, r: open(p, "wb").write(b"\x10" * 7))),
    ]
    d += [(f"random {n} bytes", written(lambda p, t, r, n=n: open(p, "wb").write(r.randbytes(n))))
          for n in (9, 4096, 3 * 2**20)]
    d += [("random bytes after a small length", written(lambda p, t, r: open(p, "wb").write(
        struct.pack("<Q", 64) + r.randbytes(4096))))]
    d += [(f"cut at {name}", written(cut(at))) for name, at in [
        ("4", lambda s, n, r: 4), ("8", lambda s, n, r: 8), ("mid-header", lambda s, n, r: 8 + n // 2),
        ("the header's end", lambda s, n, r: 8 + n), ("data byte 1", lambda s, n, r: 9 + n),
        ("a random data byte", lambda s, n, r: r.randrange(9 + n, s - 1)),
        ("another random data byte", lambda s, n, r: r.randrange(9 + n, s - 1)), ("the last byte", lambda s, n, r: s - 1)]]
    d += [
        ("a trailing byte", written(lambda p, t, r: (write_st(p, t), open(p, "ab").write(b"\0")))),
        ("header length + 16", written(lambda p, t, r: write_st(p, t, length=len(json.dumps(
            header_and_data(t)[0]).encode()) + 16))),
        ("header length 0", written(lambda p, t, r: write_st(p, t, length=0))),
        ("header length 2**63", written(lambda p, t, r: write_st(p, t, length=2**63))),
        ("header a list", written(lambda p, t, r: open(p, "wb").write(struct.pack("<Q", 2) + b"[]"))),
        ("fc.weight ends 2 bytes late", written(lambda p, t, r: write_st(p, t, shift("fc.weight", 2)))),
        ("norm.weight ends 2 bytes early", written(lambda p, t, r: write_st(p, t, shift("norm.weight", -2)))),
        ("fc.weight 8 bytes further on", written(lambda p, t, r: write_st(p, t, lambda h: [
            o.__setitem__(i, o[i] + 8) for o in [h["fc.weight"]["data_offsets"]] for i in (0, 1)]))),
        ("a shape in the header only", written(lambda p, t, r: write_st(p, t, lambda h: h["lm_head.weight"].update(
            shape=[h["lm_head.weight"]["shape"][0] * 2, h["lm_head.weight"]["shape"][1]])))),
        ("a dtype in the header only", written(lambda p, t, r: write_st(p, t, lambda h: h["norm.weight"].update(
            dtype="F32")))),
        ("an unknown dtype", written(lambda p, t, r: write_st(p, t, lambda h: h["norm.weight"].update(dtype="Q4")))),
        ("a negative offset", written(lambda p, t, r: write_st(p, t, lambda h: h["d2t"].update(
            data_offsets=[-8, h["d2t"]["data_offsets"][1] - 8])))),
        ("an entry without offsets", written(lambda p, t, r: write_st(p, t, lambda h: h["t2d"].pop("data_offsets")))),
    ]
    for name in ("fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d", "input_norm.weight",
                 "layers.0.hidden_norm.weight", "layers.0.mlp.down_proj.weight", "layers.0.self_attn.q_proj.weight",
                 "layers.0.self_attn.v_proj.weight", "layers.0.post_attention_layernorm.weight"):
        d.append((f"{name} removed", edit_tensors(lambda t, r, name=name: t.pop(name))))
    for name, grow in [("fc.weight", (0, -576)), ("lm_head.weight", (1, 0)), ("norm.weight", (1,)), ("d2t", (-1,)),
                       ("t2d", (1,)), ("layers.0.mlp.gate_proj.weight", (0, 1)),
                       ("layers.0.self_attn.k_proj.weight", (64, 0)), ("input_norm.weight", (-576,))]:
        d.append((f"{name} reshaped", edit_tensors(lambda t, r, name=name, grow=grow: t.__setitem__(name, tensor_of(
            t[name][0], [a + b for a, b in zip(t[name][1], grow)], r)))))
    d.append(("embed_tokens.weight of another width", edit_tensors(lambda t, r: t.__setitem__(
        "embed_tokens.weight", tensor_of("BF16", [49152, 64], r)))))
    d.append(("lm_head.weight rank 3", edit_tensors(lambda t, r: t.__setitem__("lm_head.weight", tensor_of(
        "BF16", t["lm_head.weight"][1] + [1], r)))))
    for name, dtype in [("d2t", "F64"), ("t2d", "U8"), ("fc.weight", "I16")]:
        d.append((f"{name} stored as {dtype}", edit_tensors(lambda t, r, name=name, dtype=dtype: t.__setitem__(
            name, [dtype, t[name][1], t[name][2]]))))
    d.append(("an unknown tensor", edit_tensors(lambda t, r: t.__setitem__("evil.weight", t["norm.weight"]))))
    d.append(("mask_hidden", edit_tensors(lambda t, r: t.__setitem__("mask_hidden", t["norm.weight"]))))
    d.append(("a bias the config does not ask for", edit_tensors(lambda t, r: t.__setitem__(
        "layers.0.self_attn.q_proj.bias", tensor_of("BF16", [t["layers.0.self_attn.q_proj.weight"][1][0]], r)))))
    d.append(("__metadata__ not a table of strings", written(lambda p, t, r: write_st(p, t, lambda h: h.update(
        __metadata__="notadict")))))
    d.append(("an extra layer", edit_tensors(lambda t, r: t.update(
        {k.replace("layers.0.", "layers.1."): v for k, v in list(t.items()) if k.startswith("layers.0.")}))))
    d.append(("a far layer", edit_tensors(lambda t, r: t.__setitem__("layers.999999.input_layernorm.weight",
                                                                      t["norm.weight"]))))
    d.append(("d2t past the vocabulary", edit_tensors(lambda t, r: t.__setitem__("d2t", ["I64", t["d2t"][1], (
        struct.pack("<q", 10**9) + t["d2t"][2][8:])]))))
    d.append(("d2t below 0", edit_tensors(lambda t, r: t.__setitem__("d2t", ["I64", t["d2t"][1], (
        struct.pack("<q", -1) + t["d2t"][2][8:])]))))
    d.append(("t2d marks one more", edit_tensors(lambda t, r: t.__setitem__("t2d", ["BOOL", t["t2d"][1], (
        lambda b: b[:b.index(0)] + b"\1" + b[b.index(0) + 1:])(bytes(t["t2d"][2]))]))))
    d.append(("d2t all zero", edit_tensors(lambda t, r: t.__setitem__("d2t", ["I64", t["d2t"][1], bytes(len(
        t["d2t"][2]))]))))
    return d


def sharded(fn):
    """The tensors written as two shards and an index; fn(folder, index) then breaks it (returning "wrote" when it
    wrote the index itself)."""
    def mutate(cfg, tensors, folder, rng):
        names = sorted(tensors)
        half = {"a": names[: len(names) // 2], "b": names[len(names) // 2:]}
        wmap = {}
        for part, keys in half.items():
            write_st(os.path.join(folder, f"model-{part}.safetensors"), {k: tensors[k] for k in keys})
            wmap.update({k: f"model-{part}.safetensors" for k in keys})
        index = {"metadata": {}, "weight_map": wmap}
        if fn(folder, index) != "wrote":  # else fn wrote the index itself
            with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f)
        return True
    return mutate


def index_mutations():
    return [
        ("a shard missing", sharded(lambda d, i: os.unlink(os.path.join(d, "model-b.safetensors")))),
        ("a shard of random bytes", sharded(lambda d, i: open(os.path.join(d, "model-a.safetensors"), "wb").write(
            random.Random(SEED).randbytes(1000)))),
        ("the index naming ../", sharded(lambda d, i: i["weight_map"].update({"fc.weight": "../x.safetensors"}))),
        ("the index naming the wrong shard", sharded(lambda d, i: i["weight_map"].update(
            {"t2d": "model-a.safetensors" if i["weight_map"]["t2d"] == "model-b.safetensors" else
             "model-b.safetensors"}))),
        ("the index without weight_map", sharded(lambda d, i: i.pop("weight_map"))),
        ("the index not JSON", sharded(lambda d, i: open(os.path.join(d, "model.safetensors.index.json"), "w").write(
            '{"weight_map": ') and "wrote")),
        ("the index a folder", sharded(lambda d, i: os.mkdir(os.path.join(d, "model.safetensors.index.json")) or
                                       "wrote")),
    ]


def build(src_cfg, src_tensors, folder, mutate, rng):
    cfg, tensors = copy.deepcopy(src_cfg), dict(src_tensors)
    os.makedirs(folder)
    wrote = mutate(cfg, tensors, str(folder), rng)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if not wrote:
        write_st(os.path.join(folder, "model.safetensors"), tensors)


def refuse_all(model_path, base, root, cases, names=()):
    """Each case built into its own folder under `root`, then given to stage 05: one line naming the draft (and one
    of `names` of the case when given), exit 2, nothing heavy imported, nothing written."""
    rng = random.Random(SEED)
    failures = []
    for i, case in enumerate(cases):
        label, mutate = case[0], case[-1]
        folder = root / f"m{i:03d}"
        build(*base, folder, mutate, rng)
        before = snapshot(folder)
        p, secs = run_script("05_evaluate.py", "--model-path", model_path, "--draft", str(folder), "--output-dir",
                             str(root / "out"), "--dry-run", timeout=60)
        try:
            line = assert_refused(p, secs, f"error: --draft {folder}: ")
            want = case[1] if len(case) == 3 else None
            if want:  # the config field, by its last key (check_draft's older lines spell hidden_size 'hidden size')
                key = want.rsplit(".", 1)[-1]
                assert key in line or key.replace("_", " ") in line, (key, line)
            assert snapshot(folder) == before and not (root / "out").exists()
        except AssertionError as e:
            failures.append(f"{label}: {e}")
        shutil.rmtree(folder)
    assert not failures, f"{len(failures)} of {len(cases)} bad drafts not refused as they should be:\n" + \
        "\n".join(failures)


FAMILIES = {"config": config_mutations, "weights": weight_mutations, "index": index_mutations}

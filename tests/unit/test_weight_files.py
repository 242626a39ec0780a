"""A checkpoint's safetensors headers and index, read as the format defines them (eagle3pipe/verifier/weight_files.py), for
verifiers through quantization.tensor_table: every malformed header or index is one line naming --model-path and the
file, never a library's traceback. The files are written byte by byte here: no torch, no model."""
import json
import os
import struct

import pytest

from eagle3pipe.verifier import quantization
from eagle3pipe.base.errors import UsageError


def _file(path, entries, data=None, raw_header=None):
    """A safetensors file: `entries` {name: (dtype, shape, [begin, end])}, then `data` bytes (as long as the entries
    need when not given)."""
    header = raw_header if raw_header is not None else json.dumps(
        {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in entries.items()}).encode()
    if data is None:
        data = bytes(max((o[1] for _, _, o in entries.values()), default=0))
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _refused(folder, *needles):
    with pytest.raises(UsageError) as e:
        quantization.tensor_table(str(folder))
    line = str(e.value)
    assert line.startswith(f"--model-path {folder}: ") and "\n" not in line, line
    for n in needles:
        assert n in line, (n, line)
    return line


GOOD = {"a": ("F32", [2, 2], [0, 16]), "b": ("BF16", [4], [16, 24])}


def test_a_whole_file_reads(tmp_path):
    _file(tmp_path / "model.safetensors", GOOD)
    assert quantization.tensor_table(str(tmp_path)) == {"a": ("F32", [2, 2], "model.safetensors"),
                                                        "b": ("BF16", [4], "model.safetensors")}


@pytest.mark.parametrize("entries, data, says", [
    ({"a": ("F32", [2, 2], [0, 16]), "b": ("BF16", [4], [8, 16])}, bytes(16), "tensor b: starts at data byte 8, the "
                                                                             "tensors before it end at 16"),  # overlap
    ({"a": ("F32", [2, 2], [0, 16]), "b": ("Q4", [4], [16, 18])}, bytes(18), "tensor b: its header entry is not a "
                                                                            "known dtype"),
    ({"a": ("F32", [2, 2], [-16, 0])}, bytes(16), "tensor a: starts at data byte -16"),  # a negative offset
    ({"a": ("F32", [10**18], [0, 16])}, bytes(16), "its shape [1000000000000000000] in F32 needs"),  # absurd shape
    ({"a": ("F32", [2, -2], [0, 16])}, bytes(16), "tensor a: its header entry is not a known dtype, a shape"),
    ({"a": ("F32", [2, 2], [8, 24])}, bytes(24), "tensor a: starts at data byte 8, the tensors before it end at 0"),
    ({"a": ("F32", [2, 2], [0, 16])}, bytes(12), "cut short"),
    ({"a": ("F32", [2, 2], [0, 16])}, bytes(20), "bytes after the last tensor"),
], ids=["overlap", "dtype", "negative", "huge", "negative-dim", "gap", "short", "trailing"])
def test_a_header_that_does_not_tile_its_file_is_named(tmp_path, entries, data, says):
    _file(tmp_path / "model.safetensors", entries, data)
    _refused(tmp_path, "model.safetensors: ", says)


@pytest.mark.parametrize("raw, says", [
    (b"[1, 2]", "its header is a JSON list"),
    (b"{\"a\": ", "its header is not JSON"),
    (json.dumps({"__metadata__": {"format": 1}}).encode(), "its __metadata__ is not a table of strings"),
])
def test_a_header_that_is_not_a_table_of_tensors_is_named(tmp_path, raw, says):
    _file(tmp_path / "model.safetensors", {}, b"", raw_header=raw)
    _refused(tmp_path, says)


def test_random_bytes_and_a_length_beyond_the_file_are_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 4)
    _refused(tmp_path, "4 bytes: empty or cut short")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    _refused(tmp_path, "its header length field says 1000000000000 bytes")


def _sharded(folder, index):
    _file(folder / "model-00001-of-00002.safetensors", {"a": ("F32", [2, 2], [0, 16])})
    _file(folder / "model-00002-of-00002.safetensors", {"b": ("BF16", [4], [0, 8])})
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))


def test_a_sharded_checkpoint_reads_through_its_index(tmp_path):
    _sharded(tmp_path, {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    assert quantization.tensor_table(str(tmp_path))["b"] == ("BF16", [4], "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("index, says", [
    ("{\"weight_map\": ", "model.safetensors.index.json: "),  # not JSON
    ({"weight_map": ["a"]}, "its weight_map is not a table of tensor -> file"),
    ({"weight_map": {}}, "its weight_map is not a table of tensor -> file"),
    ({"weight_map": {"a": 1}}, "its weight_map is not a table of tensor -> file"),
    ({"weight_map": {"a": "../model-00001-of-00002.safetensors"}}, "names '../model-00001-of-00002.safetensors', not "
                                                                    "a .safetensors file beside it"),
    ({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00003-of-00003.safetensors"}},
     "model-00003-of-00003.safetensors: missing (model.safetensors.index.json names it for 1 tensors, e.g. b)"),
    ({"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}},
     "tensor a is not in model-00002-of-00002.safetensors"),
    ({"metadata": [1], "weight_map": {"a": "model-00001-of-00002.safetensors"}}, "its metadata is a JSON list"),
], ids=["not-json", "list", "empty", "not-names", "outside", "missing-shard", "elsewhere", "metadata-list"])
def test_a_bad_index_is_named(tmp_path, index, says):
    _sharded(tmp_path, index)
    _refused(tmp_path, says)


def test_without_an_index_every_file_is_read_as_vllm_loads_a_folder(tmp_path):
    _file(tmp_path / "weights-a.safetensors", {"a": ("F32", [2, 2], [0, 16])})
    _file(tmp_path / "weights-b.safetensors", {"b": ("BF16", [4], [0, 8])})
    assert set(quantization.tensor_table(str(tmp_path))) == {"a", "b"}
    _file(tmp_path / "weights-c.safetensors", {"a": ("F32", [2, 2], [0, 16])})
    _refused(tmp_path, "weights-c.safetensors: tensor a is also in weights-a.safetensors")


def test_a_kept_definition_that_does_not_read_as_one_is_made_again(tmp_path, monkeypatch):
    """verifier_weights keeps each verifier's definition as JSON in the user's cache; a file there that is not one
    (cut, edited, another version's) is ignored, never trusted, and written anew."""
    from eagle3pipe.verifier import verifier_weights as vw
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    d = vw.Definition("LlamaForCausalLM", {"model.norm.weight": ([8], True)}, frozenset(), (), (), "model",
                      "model.embed_tokens.weight")
    path = vw._cache_file({"model_type": "llama", "hidden_size": 8})
    assert path.startswith(str(tmp_path / "eagle3pipe" / "definitions")) and vw._cached(path) is None
    vw._keep(path, d)
    assert vw._cached(path) == d and oct(os.stat(path).st_mode & 0o777) == "0o600"
    for bad in ('{"arch": 1}', "[", '{"arch": "X", "tensors": {"w": [["8"], true]}, "tied": [], "skip": [], '
                                    '"spare": [], "base": "model", "embedding": "e"}'):
        with open(path, "w") as f:
            f.write(bad)
        assert vw._cached(path) is None
    vw._keep(path, d)
    assert vw._cached(path) == d


def test_what_two_loaders_would_read_differently_is_named(tmp_path):
    """A header naming a tensor twice (JSON keeps one entry, a loader its own choice), one tensor in two shards, a
    model.safetensors beside an index naming other files (transformers loads the first, vLLM the index's), or beside
    another .safetensors file with no index (vLLM loads every one): each refused, naming the file."""
    twice = tmp_path / "twice"
    twice.mkdir()
    raw = (b'{"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}, '
           b'"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}')
    _file(twice / "model.safetensors", {}, data=bytes(8), raw_header=raw)
    _refused(twice, "model.safetensors: its header names a twice")

    both = tmp_path / "both"
    both.mkdir()
    _sharded(both, {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    _file(both / "model-00002-of-00002.safetensors", {"a": ("F32", [2, 2], [0, 16]), "b": ("BF16", [4], [16, 24])})
    _refused(both, "model-00002-of-00002.safetensors: tensor a is also in model-00001-of-00002.safetensors")

    single = tmp_path / "single"
    single.mkdir()
    _sharded(single, {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    _file(single / "model.safetensors", GOOD)
    _refused(single, "model.safetensors.index.json: names model-00001-of-00002.safetensors",
             "transformers loads model.safetensors, vLLM the index's files")

    stray = tmp_path / "stray"
    stray.mkdir()
    _file(stray / "model.safetensors", GOOD)
    _file(stray / "extra.safetensors", {"a": ("F32", [2, 2], [0, 16])})
    _refused(stray, "extra.safetensors: beside model.safetensors with no model.safetensors.index.json")
    os.remove(stray / "extra.safetensors")
    assert set(quantization.tensor_table(str(stray))) == {"a", "b"}

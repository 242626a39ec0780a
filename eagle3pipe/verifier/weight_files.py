"""A checkpoint folder's safetensors files read as the format defines them, from their headers alone (no torch, no
tensor data): an 8-byte little-endian length, that much JSON, then the data, the tensors' [begin, end) offsets tiling
it exactly, each tensor's bytes its shape times its dtype's size. The index (`model.safetensors.index.json`) is a
table of tensor -> a .safetensors file beside it that holds that tensor. Random bytes, a file cut short, overlapping
or negative offsets, an unknown dtype, a shape whose bytes the file does not hold, an index naming a missing file:
each one `Bad(file, why)`. So is what two loaders would read differently: a tensor named twice in one header (JSON
keeps one of them), or held by two files; a model.safetensors beside an index naming other files (transformers loads
the first, vLLM the index's files), or beside other .safetensors files with no index (vLLM loads every one).
Drafts (draft_weights.py) and verifiers (verifier_weights.py) are read through here.
"""
import json
import math
import os
import struct

from ..base.errors import UsageError
from ..storage.files import open_input, read_json

ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Bad(Exception):
    """A file of a checkpoint that is not what the format or its config says: `name` (its path in the folder): why."""

    def __init__(self, name, why):
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why


class _Twice(Exception):
    pass


def _once(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise _Twice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(path, shown, max_header, whose):
    """-> {tensor: (dtype, shape, file offset, path, shown)}; `shown`: how refusals name the file; `whose`: whose
    header `max_header` bounds ("a draft's")."""
    with open_input(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 8:
            raise Bad(shown, f"{size} bytes: empty or cut short, not a safetensors file")
        n = struct.unpack("<Q", fh.read(8))[0]
        if not 2 <= n <= min(max_header, size - 8):
            raise Bad(shown, f"its header length field says {n} bytes, the file holds {size} ({whose} header is at "
                             f"most {max_header}): not a safetensors file (random bytes, or cut short)")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_once)
    except _Twice as e:
        raise Bad(shown, f"its header names {str(e)[:80]} twice: which entry a loader takes is its own choice")
    except (ValueError, RecursionError):
        raise Bad(shown, "its header is not JSON: not a safetensors file (random bytes, or cut short)")
    if not isinstance(header, dict):
        raise Bad(shown, f"its header is a JSON {type(header).__name__}, not a table of tensors")
    tensors, spans = {}, []
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):  # safetensors' own rule
        raise Bad(shown, f"its __metadata__ is not a table of strings ({json.dumps(meta)[:60]})")
    for key, t in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(t, dict) and t.get("dtype") in ST_BYTES and isinstance(t.get("shape"), list)
                and all(_int(d) and d >= 0 for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
                and len(t["data_offsets"]) == 2 and all(_int(o) for o in t["data_offsets"])):
            raise Bad(shown, f"tensor {key}: its header entry is not a known dtype, a shape and two offsets "
                             f"({json.dumps(t)[:80]})")
        begin, end = t["data_offsets"]
        want = math.prod(t["shape"]) * ST_BYTES[t["dtype"]]
        if end - begin != want:
            raise Bad(shown, f"tensor {key}: its offsets [{begin}, {end}) hold {end - begin} bytes, its shape "
                             f"{t['shape']} in {t['dtype']} needs {want}: the header lies about its offsets")
        tensors[key] = (t["dtype"], t["shape"], 8 + n + begin, path, shown)
        spans.append((begin, end, key))
    at, data = 0, size - 8 - n
    for begin, end, key in sorted(spans):
        if begin != at:
            raise Bad(shown, f"tensor {key}: starts at data byte {begin}, the tensors before it end at {at}: the "
                             f"header's offsets overlap or leave a gap")
        at = end
    if at != data:
        raise Bad(shown, f"its tensors end at data byte {at}, the file holds {data} data bytes: "
                         + ("cut short" if at > data else "bytes after the last tensor"))
    return tensors


def read_index(folder):
    """-> {tensor: file} of the folder's model.safetensors.index.json, each file a .safetensors name beside it."""
    try:
        wmap = read_json(os.path.join(folder, INDEX))
    except UsageError as e:
        raise Bad(INDEX, str(e).replace(f"{os.path.join(folder, INDEX)}: ", "", 1))
    if isinstance(wmap, dict) and not isinstance(wmap.get("metadata", {}), dict):  # transformers reads its fields
        raise Bad(INDEX, f"its metadata is a JSON {type(wmap['metadata']).__name__}, not a table")
    wmap = wmap.get("weight_map") if isinstance(wmap, dict) else None
    if not (isinstance(wmap, dict) and wmap and all(isinstance(v, str) for v in wmap.values())):
        raise Bad(INDEX, "its weight_map is not a table of tensor -> file")
    for shard in sorted(set(wmap.values())):
        if os.path.basename(shard) != shard or not shard.endswith(".safetensors"):
            raise Bad(INDEX, f"names {shard!r}, not a .safetensors file beside it")
        if not os.path.lexists(os.path.join(folder, shard)):
            raise Bad(shard, f"missing ({INDEX} names it for {sum(1 for v in wmap.values() if v == shard):,} "
                             f"tensors, e.g. {min(k for k, v in wmap.items() if v == shard)})")
    return wmap


def read_weights(folder, max_header, whose, any_names=False):
    """The tensors of a folder's model.safetensors, or of the shards its model.safetensors.index.json names (each
    tensor in the file the index says); `any_names`: else every *.safetensors file there, as vLLM loads a folder.
    -> {tensor: (dtype, shape, file offset, path, shown)}"""
    single = os.path.join(folder, SINGLE)
    if os.path.lexists(single):
        if os.path.lexists(os.path.join(folder, INDEX)):
            others = sorted(set(read_index(folder).values()) - {SINGLE})
            if others:
                raise Bad(INDEX, f"names {others[0]} (and {len(others) - 1} more) beside {SINGLE}: transformers "
                                 f"loads {SINGLE}, vLLM the index's files; keep one of the two")
        beside = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors") and n != SINGLE)
        if beside and not os.path.lexists(os.path.join(folder, INDEX)):
            raise Bad(beside[0], f"beside {SINGLE} with no {INDEX}: vLLM loads every .safetensors file of the "
                                 f"folder, transformers only {SINGLE}; move it away")
        return read_header(single, SINGLE, max_header, whose)
    if not os.path.lexists(os.path.join(folder, INDEX)):
        files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")) if any_names else []
        if not files:
            raise Bad(SINGLE, f"missing (no weights in the folder, and no {INDEX})")
        out = {}
        for name in files:
            for k, v in read_header(os.path.join(folder, name), name, max_header, whose).items():
                if k in out:
                    raise Bad(name, f"tensor {k} is also in {out[k][4]} (no {INDEX} says which to load)")
                out[k] = v
        return out
    wmap, out = read_index(folder), {}
    for shard in sorted(set(wmap.values())):
        for k, v in read_header(os.path.join(folder, shard), shard, max_header, whose).items():
            if k in out:  # transformers loads every tensor of each file the index names: the later file's would win
                raise Bad(shard, f"tensor {k} is also in {out[k][4]}: two copies, and {INDEX} names one")
            out[k] = v
    lost = sorted(k for k, f in wmap.items() if k not in out or out[k][4] != f)
    if lost:
        raise Bad(INDEX, f"tensor {lost[0]} is not in {wmap[lost[0]]}" + (f" (and {len(lost) - 1:,} more tensors are "
                                                                             f"not where it says)" if len(lost) > 1
                                                                             else ""))
    return out

"""Each stage's resolved settings: one frozen, typed record, built once from the flags and `--config`, and
validated here (types, finiteness, ranges, choices, non-empty paths, rules between flags). The package's functions
take a record, or the few fields they need; never the argparse namespace.

The records have no defaults: the scripts' argparse flags hold those (and `--help` shows them), and a test checks
that every flag of a script is a field of its record. The same fields are the keys a config file may hold: at
its top level (any stage's key: each stage takes its own) or in a stage's section (that stage's keys only).
"""
import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Optional

from ..base.compute import CHOICES as DTYPES
from ..base.errors import UsageError
from ..drafts.archs import ARCHS
from ..engines import engines

STAGES = ("prepare", "extract", "vocab", "train", "evaluate")
# the config key that names a stage's output folder (it is also the later stages' input flag)
OUTPUT_KEY = {"prepare": "prepared_data", "extract": "hidden_states", "vocab": "vocab_mapping",
              "train": "checkpoint_dir", "evaluate": "eval_dir"}
# switches of one run, never taken from a config file
RUN_ONLY = {"output_dir", "dry_run", "overwrite", "verify", "shard"}


def rule(ge=None, gt=None, le=None, lt=None, choices=None, path=False):
    """A field's constraints. `path`: a string that must not be empty."""
    return field(metadata={k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, path=path).items()
                           if v is not None and v is not False})


def _flag(name):
    return "--" + name.replace("_", "-")


def _check_type(name, value, hint):
    origin, inner = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return
        hint = next(a for a in inner if a is not type(None))
        origin, inner = typing.get_origin(hint), typing.get_args(hint)
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}
    if origin in (list, tuple):
        good = isinstance(value, (list, tuple)) and all(ok[inner[0]](v) for v in value)
    else:
        good = ok[hint](value)
    if not good:
        raise UsageError(f"{_flag(name)} {value!r}: expected {kind(hint)}")
    if hint is float and not math.isfinite(value):
        raise UsageError(f"{_flag(name)} {value}: must be a finite number")


def kind(hint):
    origin, inner = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return kind(next(a for a in inner if a is not type(None)))
    if origin in (list, tuple):
        return "a list of " + {int: "integers", str: "paths"}[inner[0]]
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[hint]


def _check_rules(name, value, meta):
    if value is None:
        return
    flag = _flag(name)
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if "ge" in meta and v < meta["ge"]:
            raise UsageError(f"{flag} {value}: must be at least {meta['ge']}")
        if "gt" in meta and v <= meta["gt"]:
            raise UsageError(f"{flag} {value}: must be greater than {meta['gt']}")
        if "le" in meta and v > meta["le"]:
            raise UsageError(f"{flag} {value}: must be at most {meta['le']}")
        if "lt" in meta and v >= meta["lt"]:
            raise UsageError(f"{flag} {value}: must be less than {meta['lt']}")
    if "choices" in meta and value not in meta["choices"]:
        raise UsageError(f"{flag} {value!r}: choose one of {', '.join(meta['choices'])}")
    for v in (value if isinstance(value, (list, tuple)) else [value]) if meta.get("path") else []:
        if not v.strip():
            raise UsageError(f"{flag}: empty path")
        if "\0" in v:
            raise UsageError(f"{flag} {v!r}: a path cannot hold a NUL byte")


class Record:
    """Validation shared by the stage records: each field's type and rule, then the record's own `check()`."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, hints[f.name])
            _check_rules(f.name, value, f.metadata)
        self.check()

    def check(self):
        pass

    @classmethod
    def from_args(cls, ns):
        values = vars(ns)
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})

    def asdict(self):
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Prepare(Record):
    model_path: str = rule(path=True)
    dataset: str = rule(path=True)
    split: str = rule(path=True)
    output_dir: str = rule(path=True)
    max_seq_len: int = rule(ge=2)
    num_samples: Optional[int] = rule(ge=1)
    seed: int = rule(ge=0, le=2**32 - 1)
    num_workers: Optional[int] = rule(ge=0)  # 0: this process (no worker); stage 04's key too
    trust_remote_code: bool = rule()
    regenerate: bool = rule()
    regen_temperature: float = rule(ge=0)
    regen_max_tokens: int = rule(ge=1)
    regen_batch_size: int = rule(ge=1)
    regen_tp_size: int = rule(ge=1)
    regen_engine: str = rule(choices=("auto", "vllm", "hf"))
    regen_samples: int = rule(ge=1)
    dtype: str = rule(choices=DTYPES)


@dataclass(frozen=True)
class Extract(Record):
    model_path: str = rule(path=True)
    prepared_data: str = rule(path=True)
    output_dir: str = rule(path=True)
    backend: str = rule(choices=tuple(engines.KINDS))
    tp_size: int = rule(ge=1)
    max_seq_len: int = rule(ge=2)
    batch_size: int = rule(ge=1)
    max_tokens_per_batch: Optional[int] = rule(ge=1)
    gpu_memory_utilization: float = rule(gt=0, le=1)
    layer_ids: Optional[list[int]] = rule(ge=0)
    storage_dtype: str = rule(choices=("bf16", "fp8"))
    writer_threads: Optional[int] = rule(ge=1, le=64)
    dtype: str = rule(choices=DTYPES)
    trust_remote_code: bool = rule()
    shard: Optional[tuple[int, ...]] = rule()
    verify: bool = rule()
    dry_run: bool = rule()
    overwrite: bool = rule()

    @property
    def tokens_per_batch(self):
        """The most tokens one forward step takes: --max-tokens-per-batch, or a full batch of the longest rows. The
        preflight sizes memory by it and the vLLM engine is started with it (one formula for both)."""
        return self.max_tokens_per_batch or self.batch_size * self.max_seq_len

    def check(self):
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < self.max_seq_len:
            raise UsageError(f"--max-tokens-per-batch {self.max_tokens_per_batch}: must be at least --max-seq-len "
                             f"({self.max_seq_len}) so the longest sample fits")
        if self.shard and self.overwrite:
            raise UsageError("--overwrite with --shard: one replica would delete the others' files; "
                             "clear --output-dir once before starting the replicas")
        if self.verify and self.shard:
            raise UsageError("--verify checks all shards at once; drop --shard")
        if self.verify and self.overwrite:  # --overwrite deletes what --verify was asked to check
            raise UsageError("--verify with --overwrite: --overwrite deletes every file of earlier runs, --verify checks "
                             "them without loading a model; drop one")


@dataclass(frozen=True)
class Vocab(Record):
    prepared_data: str = rule(path=True)
    draft_vocab_size: int = rule(ge=1)
    output_dir: str = rule(path=True)


@dataclass(frozen=True)
class Train(Record):
    model_path: str = rule(path=True)
    prepared_data: str = rule(path=True)
    hidden_states: str = rule(path=True)
    vocab_mapping: str = rule(path=True)
    output_dir: str = rule(path=True)
    epochs: int = rule(ge=1)
    lr: float = rule(gt=0, lt=1)
    max_steps: Optional[int] = rule(ge=1)
    warmup_steps: Optional[int] = rule(ge=0)
    total_seq_len: int = rule(ge=16)
    num_layers: int = rule(ge=1, le=32)
    ttt_steps: int = rule(ge=1)
    # the draft's recipe: speculators' own options, passed through (training.recipe)
    draft_arch: str = rule(choices=("auto", *ARCHS))
    norm_before_fc: Optional[bool] = rule()  # None: on unless fc_norm (the two are exclusive)
    fc_norm: bool = rule()
    norm_output: bool = rule()
    loss_fn: str = rule(path=True)
    ttt_step_loss_decay: float = rule(gt=0, le=1)
    optimizer: str = rule(choices=("adamw", "muon"))
    scheduler: str = rule(choices=("linear", "cosine", "none"))
    device: str = rule(choices=("auto", "cpu", "cuda"))
    checkpoint_freq: float = rule(gt=0)
    log_every: int = rule(ge=1)
    profile_steps: int = rule(ge=0, le=1000)
    val_ratio: float = rule(gt=0, lt=1)
    num_samples: Optional[int] = rule(ge=1)
    measure_prompts: int = rule(ge=0, le=10000)
    measure_tokens: int = rule(ge=1, le=4096)
    num_workers: Optional[int] = rule(ge=0)
    fsdp: bool = rule()
    loss_implementation: str = rule(choices=("auto", "fused", "eager"))
    dtype: str = rule(choices=DTYPES)
    seed: int = rule(ge=0, le=2**32 - 1)
    verify_data: bool = rule()
    trust_remote_code: bool = rule()
    overwrite: bool = rule()
    online: bool = rule()
    backend: str = rule(choices=tuple(engines.KINDS))
    layer_ids: Optional[list[int]] = rule(ge=0)
    cache_gb: float = rule(ge=0)
    engine_address: Optional[str] = rule(path=True)
    engine_spool: Optional[str] = rule(path=True)
    engine_gpus: Optional[list[int]] = rule(ge=0)
    engine_port: Optional[int] = rule(ge=1, le=65535)
    engine_memory: Optional[float] = rule(gt=0, le=1)
    engine_timeout: int = rule(ge=1)

    # layer_ids and backend are shared with stage 02 (a config's top level gives both stages the same): offline,
    # stage 04 checks layer_ids against what stage 02 recorded and has no use for backend
    ONLINE_ONLY = ("cache_gb", "engine_address", "engine_spool", "engine_gpus", "engine_port", "engine_memory")

    LOSSES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")  # speculators 0.9's (a unit test compares)

    def check_loss(self):
        """--loss-fn: one of LOSSES, or a JSON object of them with positive weights ('{"ce": 0.1, "tv": 0.9}')."""
        if self.loss_fn in self.LOSSES:
            return
        def once(pairs):  # '{"ce": 0.1, "ce": 0.9}' would keep the last weight in silence
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise UsageError(f"--loss-fn {self.loss_fn!r}: "
                                 f"'{next(k for k in keys if keys.count(k) > 1)}' given twice; give each loss once")
            return dict(pairs)
        try:
            spec = json.loads(self.loss_fn, object_pairs_hook=once)
        except (ValueError, RecursionError):
            spec = None
        if not (isinstance(spec, dict) and spec and all(k in self.LOSSES for k in spec) and all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 and w != float("inf")
                for w in spec.values())):
            raise UsageError(f"--loss-fn {self.loss_fn!r}: give one of {', '.join(self.LOSSES)}, or a JSON object of them "
                             f"with positive weights, e.g. '{{\"ce\": 0.1, \"tv\": 0.9}}'")

    def check(self):
        self.check_loss()
        if self.norm_before_fc and self.fc_norm:
            raise UsageError("--norm-before-fc and --fc-norm: one norm before the FC projection or the other, not both "
                             "(--fc-norm alone turns the first off)")
        if not self.online:
            given = [f for f in self.ONLINE_ONLY if getattr(self, f) not in (None, 0, 0.0)]
            if given:
                raise UsageError(f"{_flag(given[0])}: only with --online (offline training reads the states stage 02 "
                                 f"wrote)")
            return
        if self.engine_address is not None:
            host, _, port = self.engine_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"--engine-address {self.engine_address!r}: give host:port, e.g. 10.0.0.5:8000")
            if self.engine_spool is None:
                raise UsageError("--engine-address: give --engine-spool too, the folder that engine writes its files to "
                                 "(its --spool); stage 04 reads and deletes an engine's files only inside it")
            clash = [f for f in ("engine_gpus", "engine_port", "engine_memory") if getattr(self, f) is not None]
            if clash:
                raise UsageError(f"{_flag(clash[0])}: configures the engine stage 04 starts; with --engine-address "
                                 f"the engine is already running")
        elif self.engine_spool is not None:
            raise UsageError("--engine-spool: only with --engine-address; the engine stage 04 starts writes to "
                             "<output-dir>/.online")


@dataclass(frozen=True)
class Evaluate(Record):
    model_path: str = rule(path=True)
    draft: list[str] = rule(path=True)
    prompts: str = rule(path=True)
    prepared_data: str = rule(path=True)
    num_prompts: int = rule(ge=1, le=100_000)
    num_speculative_tokens: int = rule(ge=1)
    max_new_tokens: int = rule(ge=1)
    batch_sizes: list[int] = rule(ge=1, le=4096)  # vLLM's max_num_seqs: its buffers are sized by the largest
    tp_size: int = rule(ge=1)
    gpu_memory_utilization: float = rule(gt=0, le=1)
    output_dir: str = rule(path=True)
    trust_remote_code: bool = rule()
    dtype: str = rule(choices=DTYPES)
    measure: str = rule(choices=("auto", "on", "off"))
    vllm: str = rule(choices=("auto", "on", "off"))
    dry_run: bool = rule()

    MAX_SPECULATIVE_TOKENS = 32

    def check(self):
        if self.num_speculative_tokens > self.MAX_SPECULATIVE_TOKENS:
            raise UsageError(f"--num-speculative-tokens {self.num_speculative_tokens}: at most "
                             f"{self.MAX_SPECULATIVE_TOKENS} (the draft chains its own guesses, so past a few positions "
                             f"almost nothing is accepted, and vLLM sizes its buffers by it); stage 04 trains for "
                             f"--ttt-steps (3 by default)")
        if not self.batch_sizes:
            raise UsageError("--batch-sizes: give at least one size, e.g. 1,8")
        if not self.draft:
            raise UsageError("--draft: give at least one checkpoint or stage 04 folder")


RECORDS = {"prepare": Prepare, "extract": Extract, "vocab": Vocab, "train": Train, "evaluate": Evaluate}


def path_fields():
    """The fields that hold paths (rule(path=True)): an empty one in a config is refused naming the key."""
    return {f.name for cls in RECORDS.values() for f in dataclasses.fields(cls) if f.metadata.get("path")}


def on_off_keys():
    """The string fields whose choices hold "on" and "off" (a config's bare on/off arrives as a YAML boolean)."""
    return {f.name for cls in RECORDS.values() for f in dataclasses.fields(cls)
            if {"on", "off"} <= set(f.metadata.get("choices", ()))}


def config_keys(stage):
    """{config key: (record field, type hint)} a config file may set for `stage`."""
    cls = RECORDS[stage]
    hints = typing.get_type_hints(cls)
    keys = {f.name: (f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.name not in RUN_ONLY}
    keys[OUTPUT_KEY[stage]] = ("output_dir", hints["output_dir"])
    return keys

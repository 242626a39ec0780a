"""The pure rules, no model: which names a stage owns, which output paths are refused, the one-writer lock, and
the typed settings records (types, finiteness, ranges, choices, rules between flags) with the config file's keys."""
import math
import os
import sys
import types

import pytest

from conftest import REPO
from eagle3pipe.config import cli, settings
from eagle3pipe.storage import outdir
from eagle3pipe.config.cli import UsageError


def _claim(d, stage="vocab", **kw):
    return outdir.claim("--output-dir", str(d), stage, **kw)


def test_ownership_is_identity_recorded_after_creation(tmp_path):
    d = tmp_path / "out"
    _claim(d)
    from eagle3pipe.storage import files
    files.write_json(str(d / "a.json"), {"x": 1})
    assert outdir.owned(str(d / "a.json"))
    assert not outdir.owned(str(d / "b.json"))  # never made: a name alone is nothing
    os.remove(d / "a.json")
    (d / "a.json").write_text("a person's file of the same name\n")
    assert not outdir.owned(str(d / "a.json"))
    assert outdir.remove(str(d / "a.json")) == [str(d / "a.json")] and (d / "a.json").exists()
    with pytest.raises(cli.RunError, match="not this stage's"):  # and never replaced
        files.write_json(str(d / "a.json"), {"x": 2})
    assert (d / "a.json").read_text() == "a person's file of the same name\n"


def test_folders_holding_anything_not_ours_are_refused(tmp_path):
    for name in (".git", ".env", "notes.txt"):
        d = tmp_path / name.strip(".")
        d.mkdir()
        (d / name).mkdir() if name == ".git" else (d / name).write_text("x")
        with pytest.raises(UsageError, match=f"holds '{name}'"):
            outdir.check("--output-dir", str(d), "vocab")
    d = tmp_path / "other_stage"
    d.mkdir()
    _claim(d, "prepare")
    with pytest.raises(UsageError, match="holds the output of stage 'prepare'"):
        outdir.check("--output-dir", str(d), "vocab")


@pytest.mark.parametrize("text", ["", "not json\n", '{"stage": "vocab", "version": 2}\n["../x", ["f", 1, 2, 3, 4, ""]]\n',
                                  '{"stage": "vocab", "version": 2}\n["a", ["f", "1", 2, 3, 4, ""]]\n', "[1, 2]\n"])
def test_a_malformed_record_is_one_line_and_nothing_is_touched(tmp_path, text):
    d = tmp_path / "out"
    d.mkdir()
    (d / outdir.LEDGER).write_text(text)
    with pytest.raises(UsageError, match="(malformed|unreadable) ownership record") as e:
        outdir.check("--output-dir", str(d), "vocab")
    assert "\n" not in str(e.value) and os.listdir(d) == [outdir.LEDGER]


def test_links_planted_at_the_lock_the_temporaries_and_subfolders_are_never_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("a person's file\n")
    d = tmp_path / "out"
    d.mkdir()
    (d / outdir.LOCK).symlink_to(victim)
    with pytest.raises(UsageError, match="cannot be the lock \\(a link\\)"):
        _claim(d)
    os.remove(d / outdir.LOCK)
    _claim(d)
    (d / "sub").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(UsageError, match="a link"):
        outdir.make_dir(str(d / "sub"))
    from eagle3pipe.storage import files
    files.write_json(str(d / "m.json"), {})  # its temporary name is fresh and O_EXCL: a planted one is never opened
    d2 = tmp_path / "out2"
    d2.mkdir()
    os.link(victim, d2 / outdir.LOCK)  # a hard link: O_NOFOLLOW does not see it
    with pytest.raises(UsageError, match="a hard link"):
        _claim(d2)
    assert victim.read_text() == "a person's file\n"
    assert outdir.remove(str(d / "sub")) == [str(d / "sub")] and os.listdir(tmp_path / "out" / "sub")


def test_engine_paths_are_used_only_inside_the_spool(tmp_path):
    from eagle3pipe.formats.spool import remove_spool_file
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "hs.safetensors").write_text("x")
    outside = tmp_path / "precious.safetensors"
    outside.write_text("x")
    (spool / "link.safetensors").symlink_to(outside)
    assert outdir.confined(str(spool), str(spool / "hs.safetensors"))
    for p in (str(outside), str(spool / "link.safetensors"), str(spool / ".." / "precious.safetensors"), "", None):
        assert not outdir.confined(str(spool), p)
        assert not remove_spool_file(str(spool), p)
    assert outside.exists()


@pytest.mark.parametrize("path,needle", [
    ("", "empty path"), ("  ", "empty path"), ("/", "filesystem root"), ("~", "home folder"),
    (REPO, "repository root"), (os.path.dirname(REPO), "contains the repository root"), (".", "the working folder"),
    ("..", "contains the working folder"),
])
def test_refused_output_paths(path, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "..")  # a working folder of its own: "." is not the repository here
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=needle):
        outdir.check_path("--output-dir", path)


def test_outputs_that_are_inside_or_contain_an_input(tmp_path):
    data = tmp_path / "in"
    data.mkdir()
    (data / "chats.jsonl").write_text("{}\n")
    for out, word in ((data, "is the input"), (data / "sub", "is inside the input"), (tmp_path, "contains the input")):
        with pytest.raises(UsageError, match=word):
            outdir.check_path("--output-dir", str(out), [("--dataset", str(data))])
    with pytest.raises(UsageError, match="contains the input --dataset .*chats.jsonl"):  # a file inside the output
        outdir.check_path("--output-dir", str(data), [("--dataset", str(data / "chats.jsonl"))])
    link = tmp_path / "link"
    link.symlink_to(data, target_is_directory=True)  # resolved first: a symlink to an input is that input
    with pytest.raises(UsageError, match="is the input"):
        outdir.check_path("--output-dir", str(link), [("--dataset", str(data))])
    assert outdir.check_path("--output-dir", str(tmp_path / "new"), [("--dataset", str(data))])


def record(cls, **over):
    base = {f: None for f in cls.__dataclass_fields__}
    base.update(model_path="m", dataset="d", split="train", output_dir="o", prepared_data="p", hidden_states="h",
                vocab_mapping="v", draft=["x"], prompts="sharegpt", backend="vllm", storage_dtype="bf16", device="auto", dtype="auto",
                loss_implementation="auto", max_seq_len=16, seed=0, tp_size=1, batch_size=1, epochs=1, lr=1e-3,
                total_seq_len=64, num_layers=1, ttt_steps=1, checkpoint_freq=1.0, log_every=1, profile_steps=0, val_ratio=0.1,
                num_prompts=1, num_speculative_tokens=1, max_new_tokens=1, batch_sizes=[1], draft_vocab_size=8,
                gpu_memory_utilization=0.5, regen_temperature=0.0, regen_max_tokens=1, regen_batch_size=1,
                regen_tp_size=1, cache_gb=0.0, engine_timeout=60, draft_arch="auto", loss_fn="kl_div",
                ttt_step_loss_decay=1.0, optimizer="muon", scheduler="linear", measure="auto", measure_prompts=32,
                measure_tokens=64, vllm="auto")
    for flag in ("trust_remote_code", "regenerate", "verify", "verify_data", "dry_run", "overwrite", "fsdp", "online",
                 "fc_norm", "norm_output"):
        base[flag] = False
    base.update(over)
    return cls(**{k: v for k, v in base.items() if k in cls.__dataclass_fields__})


@pytest.mark.parametrize("cls,over,needle", [
    (settings.Train, {"checkpoint_freq": math.nan}, "--checkpoint-freq nan: must be a finite number"),
    (settings.Train, {"checkpoint_freq": math.inf}, "finite"),
    (settings.Train, {"warmup_steps": -5}, "--warmup-steps -5: must be at least 0"),
    (settings.Train, {"num_workers": -1}, "--num-workers -1: must be at least 0"),
    (settings.Train, {"measure_prompts": -1}, "--measure-prompts -1: must be at least 0"),
    (settings.Train, {"num_samples": 0}, "--num-samples 0: must be at least 1"),
    (settings.Train, {"lr": 1.5}, "--lr 1.5: must be less than 1"),
    (settings.Train, {"device": "tpu"}, "--device 'tpu': choose one of auto, cpu, cuda"),
    (settings.Train, {"epochs": True}, "--epochs True: expected an integer"),
    (settings.Train, {"num_layers": 1000}, "--num-layers 1000: must be at most 32"),
    (settings.Train, {"seed": -1}, "--seed -1: must be at least 0"),
    (settings.Train, {"loss_fn": "mse"}, "--loss-fn 'mse': give one of kl_div"),
    (settings.Train, {"loss_fn": '{"ce": 0.1, "tv": -1}'}, "a JSON object of them with positive weights"),
    (settings.Train, {"loss_fn": '{"ce": NaN}'}, "--loss-fn"),
    (settings.Train, {"loss_fn": '{"ce": 0.1, "ce": 0.9}'}, "'ce' given twice"),
    (settings.Train, {"loss_fn": "[" * 100000}, "--loss-fn"),
    (settings.Train, {"ttt_step_loss_decay": 0.0}, "--ttt-step-loss-decay 0.0: must be greater than 0"),
    (settings.Train, {"optimizer": "sgd"}, "--optimizer 'sgd': choose one of adamw, muon"),
    (settings.Train, {"scheduler": "step"}, "--scheduler 'step'"),
    (settings.Train, {"draft_arch": "mistral"}, "--draft-arch 'mistral'"),
    (settings.Train, {"norm_before_fc": True, "fc_norm": True}, "--norm-before-fc and --fc-norm: one norm"),
    (settings.Extract, {"gpu_memory_utilization": 0.0}, "must be greater than 0"),
    (settings.Extract, {"writer_threads": 65}, "--writer-threads 65: must be at most 64"),
    (settings.Extract, {"layer_ids": [2, -1]}, "--layer-ids"),
    (settings.Extract, {"max_tokens_per_batch": 8}, "--max-tokens-per-batch 8: must be at least --max-seq-len"),
    (settings.Extract, {"shard": (0, 2), "overwrite": True}, "--overwrite with --shard"),
    (settings.Prepare, {"regen_temperature": -0.1}, "--regen-temperature -0.1"),
    (settings.Prepare, {"output_dir": ""}, "--output-dir: empty path"),
    (settings.Evaluate, {"batch_sizes": []}, "--batch-sizes"),
    (settings.Evaluate, {"batch_sizes": [1, 0]}, "--batch-sizes"),
    (settings.Evaluate, {"draft": []}, "--draft: give at least one"),
    (settings.Evaluate, {"draft": ["a", " "]}, "--draft: empty path"),
    (settings.Evaluate, {"draft": "a"}, "--draft 'a': expected a list of paths"),
    (settings.Vocab, {"draft_vocab_size": "8"}, "expected an integer"),
])
def test_records_refuse_bad_values(cls, over, needle):
    with pytest.raises(UsageError, match=needle.replace("(", "\\(").replace(")", "\\)")):
        record(cls, **over)


def test_records_are_frozen_and_serialize():
    r = record(settings.Train)
    with pytest.raises(Exception):
        r.lr = 0.5
    assert r.asdict()["lr"] == 1e-3


@pytest.mark.parametrize("text,needle", [
    ("seed: 1\nseed: 2\n", "key 'seed' given twice (line 2)"),
    ("train:\n  lr: 0.1\n  lr: 0.2\n", "key 'lr' given twice (line 3)"),
    ("prepare:\n  total_seq_len: 4\n", "unknown key 'prepare.total_seq_len' (stage prepare does not take it)"),
    ("vocab:\n  model_path: x\n", "unknown key 'vocab.model_path'"),
    ("extract:\n  dry_run: true\n", "unknown key 'extract.dry_run'"),
    ("output_dir: x\n", "unknown key 'output_dir' (a stage's output folder is named by its product's key: prepare: "
                        "prepared_data, extract: hidden_states, vocab: vocab_mapping, train: checkpoint_dir"),
    ("vocab:\n  output_dir: x\n", "unknown key 'vocab.output_dir' (stage vocab does not take it); did you mean "
                                  "'vocab_mapping'?"),
    ("checkpoint_freq: .nan\n", "key 'checkpoint_freq' must be a number"),
    ("layer_ids: [2, x]\n", "key 'layer_ids' must be a list of integers"),
    ("[" * 5000 + "]" * 5000 + "\n", "not valid YAML"),
    ("seed: " + "9" * 5000 + "\n", "not valid YAML (Exceeds the limit (4300 digits)"),  # Python's own limit
    ("p: &p {lr: 0.1}\ntrain: {<<: *p, lr: 0.2, lr: 0.3}\n", "key 'lr' given twice"),  # beside a merge too
    ("[1, 2]: 3\n", "a key must be a plain name, not a sequence"),  # a list as a mapping key
    ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\ng: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\ni: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]\nepochs: *i\n", "more than 64 aliases"),  # a "billion laughs" expansion
    ("# x\n" * 300_000, "a config is at most 1,048,576 bytes"),
])
def test_config_file_refusals(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=needle.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
        cli.load_config(str(path), "train")


def test_a_yaml_merge_key_gives_its_keys_and_a_key_beside_it_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("_common: &common\n  lr: 0.01\n  epochs: 4\ntrain:\n  <<: *common\n  lr: 0.02\n")
    with pytest.raises(UsageError, match="unknown key '_common"):  # the anchor's own key is checked like any
        cli.load_config(str(path), "train")
    path.write_text("train:\n  <<: {lr: 0.01, epochs: 4}\n  lr: 0.02\n")
    got = cli.load_config(str(path), "train")
    assert (got["lr"], got["epochs"]) == (0.02, 4)


def test_every_failure_is_one_line_with_the_right_exit_code():
    import errno
    cases = [(OSError(errno.ENOSPC, "No space left on device", "/d/hs_1.safetensors"), 1, "the disk is full"),
             (OSError(errno.EFBIG, "File too large", "/d/x"), 1, "ulimit -f"),
             (OSError(errno.EROFS, "Read-only file system", "/d"), 2, "read-only"),
             (OSError(errno.ENAMETOOLONG, "File name too long", "/d/" + "x" * 300), 2, "too long"),
             (OSError(errno.ELOOP, "Too many levels of symbolic links", "/d/loop"), 2, "link loop"),
             (OSError(errno.ENOENT, "No such file or directory", "/gone"), 2, "working folder deleted"),
             (MemoryError(), 1, "out of memory"), (UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "bad"), 2, "UTF-8"),
             (ValueError("line one\nline two"), 1, "ValueError: line one line two"),
             (cli.RunError("Caught RunError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                           "last):\n  File x\neagle3pipe.cli.RunError: 3 of 24 samples are bad"), 1,
              "3 of 24 samples are bad")]
    for exc, code, needle in cases:
        got, line = cli.describe(exc)
        assert got == code and needle in line and "\n" not in line, (exc, got, line)
    name = os.fsdecode(b"caf\xe9\nnotes")  # Latin-1 bytes and a newline in a file name
    assert cli.oneline(f"{name}: not a folder") == "caf\\xe9\\nnotes: not a folder"


def test_a_gpu_out_of_memory_reads_as_its_figures_and_the_stage_flag_that_bounds_it(monkeypatch):
    """torch's CUDA out-of-memory paragraph (the first from an H100 that four stage 04 runs shared) as one line: what
    was asked, what was free of what, who held the rest; freeing the card and resuming first, then what the stage
    named (stage 04: --total-seq-len, which starts over). A full card's "0 bytes", a driver's 16-EiB non-figure, a
    container's PID namespace (no "this process") and CUDA_VISIBLE_DEVICES' renumbering each read right."""
    import torch
    from eagle3pipe.base import errors
    from eagle3pipe.train import train_plan
    from eagle3pipe.storage.rows import Rows
    monkeypatch.setattr(sys, "argv", ["04_train.py"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(errors, "MEMORY", {})
    oom = lambda text, **kw: cli.describe(torch.OutOfMemoryError(text), **kw)
    shared = ("CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.57 "
              "GiB is free. Process 835 has 21.00 GiB memory in use. Including non-PyTorch memory, this process has "
              "14.55 GiB memory in use. Process 833 has 21.01 GiB memory in use. Process 832 has 512.00 MiB memory in "
              "use. Of the allocated memory 10.20 GiB is allocated by PyTorch")
    figures = ("GPU 0 out of memory: asked for 4.00 GiB with 1.57 GiB free of 79.18 GiB; this process held 14.55 GiB, "
               "3 other processes 42.51 GiB (pids 835, 833, 832)")
    assert oom(shared) == (1, figures + "; free the GPU, then rerun the same command to resume")
    assert oom(shared, advice=False) == (1, figures)  # a measure that failed while the run goes on: no rerun advice
    full = ("CUDA out of memory. Tried to allocate 512 bytes. GPU 1 has a total capacity of 79.15 GiB of which 0 bytes "
            "is free. Process 1234 has 17179869184.00 GiB memory in use. Process 99 has 70.00 GiB memory in use.")
    assert oom(full, advice=False)[1] == ("GPU 1 out of memory: asked for 512 bytes with 0 bytes free of 79.15 GiB; 1 "
                                          "process held 70.00 GiB (pid 99)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert oom(full, advice=False)[1].startswith("GPU 1 (nvidia-smi GPU 3) out of memory")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    plan = lambda longest, on_gpu=True, online=False: train_plan.memory_hint(
        types.SimpleNamespace(total_seq_len=8192, ttt_steps=3), Rows.from_lists([([0] * longest, None)]), on_gpu, online)
    monkeypatch.setattr(errors, "MEMORY", plan(2048))
    assert oom(shared)[1] == (figures + "; free the GPU, then rerun the same command to resume; or lower "
                              "--total-seq-len (8,192 now; the longest row needs 2,048) and start over with "
                              "--overwrite or another --output-dir")
    monkeypatch.setattr(errors, "MEMORY", plan(8192, online=True))  # nothing left to lower: the rows, the TTT steps
    assert oom(shared)[1].endswith("; or shorten the rows (stage 01's --max-seq-len: --total-seq-len 8,192 is already "
                                   "the longest row's) or use fewer --ttt-steps (3 now), and start over with "
                                   "--overwrite or another --output-dir; or give the engine less (--engine-memory) or "
                                   "GPUs of its own (--engine-gpus)")
    other = oom("HIP out of memory,\nsome other wording")[1]
    assert other.startswith("out of GPU memory (HIP out of memory, some other wording); free the GPU")
    monkeypatch.setattr(errors, "MEMORY", plan(2048, on_gpu=False))  # a CPU run: the RAM is what --total-seq-len fills
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)")
    assert cli.describe(cpu) == (1, "out of memory (RAM: asked for 32.00 GiB); free memory, then rerun the same "
                                    "command to resume; or lower --total-seq-len (8,192 now; the longest row needs "
                                    "2,048) and start over with --overwrite or another --output-dir")
    assert cli.describe(MemoryError())[1].startswith("out of memory; free memory, then rerun the same command")


def test_an_interrupted_overwrite_run_is_told_to_resume_without_overwrite(monkeypatch):
    """Rerunning a stopped --overwrite run as it was would delete what it made and start over."""
    import errno
    disk_full = OSError(errno.ENOSPC, "No space left on device", "/d/x")
    monkeypatch.setattr(sys, "argv", ["04_train.py", "--lr", "1e-3"])
    assert cli.describe(disk_full)[1].endswith("then rerun the same command to resume")
    monkeypatch.setattr(sys, "argv", ["04_train.py", "--lr", "1e-3", "--overwrite"])
    assert cli.describe(disk_full)[1].endswith("then rerun the same command without --overwrite to resume")


def test_inputs_must_be_regular_files_and_npy_headers_match_their_size(tmp_path):
    import numpy as np
    from numpy.lib import format as npy
    from eagle3pipe.storage import files
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="is a FIFO, not a regular file"):
        files.read_json(str(tmp_path / "fifo"))  # would wait forever for a writer
    with open(tmp_path / "big.npy", "wb") as f:
        npy.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10 ** 12,)})
        f.write(b"\0" * 80)
    with pytest.raises(ValueError, match="header claims 8,000,000,000,000 bytes"):
        files.load_npy(str(tmp_path / "big.npy"))
    np.save(tmp_path / "ok.npy", np.arange(5))
    assert files.load_npy(str(tmp_path / "ok.npy")).tolist() == [0, 1, 2, 3, 4]


def test_the_hub_probe_has_a_deadline_for_an_endpoint_that_never_answers(monkeypatch):
    import socket
    import time
    from eagle3pipe.verifier import hub
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    t0 = time.time()
    assert hub.hub_reachable(timeout=1.0) is False
    assert time.time() - t0 < 2
    silent.close()


def test_config_top_level_keys_apply_only_to_the_stages_that_take_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("draft_vocab_size: 100\nmax_seq_len: 64\nvocab_mapping: v\nprepare:\n  num_samples: 3\n")
    assert cli.load_config(str(path), "prepare") == {"max_seq_len": 64, "num_samples": 3}
    assert cli.load_config(str(path), "vocab") == {"draft_vocab_size": 100, "output_dir": "v"}
    assert cli.load_config(str(path), "train") == {"vocab_mapping": "v"}


def test_the_greedy_equality_line_explains_each_divergence():
    from eagle3pipe.evaluate.evaluation import explain
    assert explain([], 8) == "greedy outputs identical at batch size 1: 8/8"
    tie = {"prompt": 1, "position": 9, "without_draft": 5, "with_draft": 7, "verifier_top2": [5, 7], "margin": 0.12}
    clear = {"prompt": 3, "position": 2, "without_draft": 5, "with_draft": 9, "verifier_top2": [5, 7], "margin": 3.1}
    line = explain([tie, clear, {"prompt": 4, "position": 20, "margin": None, "reason": "length only"}], 8)
    assert line.startswith("greedy outputs identical at batch size 1: 5/8; ")
    assert "1 diverge where the verifier's top two tokens are within 0.12 nats (bf16 numerics, not the draft)" in line
    assert "1 differ only in length" in line and "prompt 3, token 2: margin 3.1 nats): worth a look" in line


def test_serving_blocker_and_command(tmp_path):
    from eagle3pipe.engines import engine
    assert engine.eagle3_blocker({"hidden_size": 8}, on_gpu=False) is None  # no MLA
    assert engine.eagle3_blocker({"kv_lora_rank": 512}, on_gpu=True) is None
    amx = " amx_tile" in open("/proc/cpuinfo").read()
    assert (engine.eagle3_blocker({"kv_lora_rank": 512}, on_gpu=False) is None) == amx
    cmd = engine.serve_command("m", "d/last", 3)
    assert '"method": "eagle3"' in cmd and '"num_speculative_tokens": 3' in cmd
    assert engine.serve_command("m", "d", 3, elsewhere=True).startswith("vllm serve m ")


def test_quantized_embedding_or_head_is_refused(tmp_path):
    import json
    import struct
    from eagle3pipe.verifier import verifier

    def shard(name, tensors):  # [2, 2] tensors whose offsets tile the file, as the format requires
        size = {"BF16": 2, "F16": 2, "I32": 4, "F8_E4M3": 1}
        header, at = {}, 0
        for k, d in tensors.items():
            header[k] = {"dtype": d, "shape": [2, 2], "data_offsets": [at, at + 4 * size[d]]}
            at += 4 * size[d]
        raw = json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(at))
    shard("model.safetensors", {"model.embed_tokens.weight": "BF16", "lm_head.weight_packed": "I32",
                                "lm_head.weight_scale": "BF16"})
    with pytest.raises(UsageError, match="lm_head.weight_packed is quantized"):
        verifier.check_draft_sources(str(tmp_path), tied=False)
    verifier.check_draft_sources(str(tmp_path), tied=True)  # tied: the embedding serves as the head
    shard("model.safetensors", {"model.embed_tokens.weight": "F8_E4M3", "lm_head.weight": "BF16"})
    with pytest.raises(UsageError, match="model.embed_tokens.weight is stored as F8_E4M3"):
        verifier.check_draft_sources(str(tmp_path), tied=False)
    shard("model.safetensors", {"language_model.model.embed_tokens.weight": "BF16", "language_model.lm_head.weight": "F16"})
    verifier.check_draft_sources(str(tmp_path), tied=False)  # a wrapper's prefixed names resolve by suffix


def test_memory_model_for_mla_and_moe_and_int4_weights(tmp_path):
    import json
    from eagle3pipe.extract.preflight import per_token_bytes
    from eagle3pipe.verifier.verifier import weights_bytes
    kimi = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 64, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_experts_per_tok": 8, "n_shared_experts": 1}
    kv, states = 61 * (512 + 64) * 2, 2 * 4 * 7168 * 2  # this batch's and the held one's; the MLA latent per layer, not heads x head_dim x 2
    assert per_token_bytes(kimi, 4) == kv + states + (4 * 7168 + 2 * 18432) * 4
    kimi["num_experts_per_tok"] = 12  # routed + shared widths beyond the dense MLP's count instead
    assert per_token_bytes(kimi, 4) == kv + states + (4 * 7168 + 2 * 13 * 2048) * 4
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    assert weights_bytes(str(tmp_path)) == 100
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 594_000_000_000},
                                                                       "weight_map": {}}))
    assert weights_bytes(str(tmp_path)) == 594_000_000_000  # the index: what an INT4 checkpoint really holds


def test_a_stage02_manifest_that_contradicts_its_own_identity_is_refused(tmp_path):
    import json
    from eagle3pipe import FORMAT_VERSION
    from eagle3pipe.storage import files
    from eagle3pipe.verifier.verifier import IDENTITY
    m = {"stage": "extract", "format_version": FORMAT_VERSION, "args": {}, "content_id": "c",
         "verifier": {k: None for k in IDENTITY}, "counts": {"rows": 3},
         "identity": {"prepared": "p", "layer_ids": [2, 15, 27, 30], "rows": 3}, "layer_ids": [2, 15, 27, 30]}
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert files.load_stage("--hidden-states", str(tmp_path), "extract")["layer_ids"] == [2, 15, 27, 30]
    m["layer_ids"] = [3, 15, 27, 30]  # hand-edited: the files hold layer 2
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UsageError, match="'layer_ids' is \\[3, 15, 27, 30\\] but its identity record says"):
        files.load_stage("--hidden-states", str(tmp_path), "extract")


def test_an_engine_port_that_speaks_something_else_is_one_line():
    import socket
    import threading
    from eagle3pipe.train import online_plan
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def answer():
        try:
            while True:
                conn, _ = srv.accept()
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                conn.close()
        except OSError:  # the test closed the socket
            pass
    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(UsageError, match="no engine answers .*not an HTTP answer"):
        online_plan.check_address("--engine-address", f"127.0.0.1:{srv.getsockname()[1]}", "m")
    srv.close()


def test_a_hand_edited_record_never_gets_a_person_s_file_deleted(tmp_path):
    import json
    head = json.dumps({"stage": "vocab", "version": 2}) + "\n"
    d = tmp_path / "out"
    d.mkdir()
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    (sentinel / ".a.txt.tmp-1-0123abcd").write_text("someone else's\n")
    (d / "lnk").symlink_to(sentinel, target_is_directory=True)
    st = os.lstat(d / "lnk")
    # a link listed with its true identity, and a "temporary file" reached through it
    (d / outdir.LEDGER).write_text(
        head + json.dumps(["lnk", ["l", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, str(sentinel)]]) + "\n"
        + json.dumps(["lnk/.a.txt.tmp-1-0123abcd", ["t", 0, 0, 0, 0, ""]]) + "\n")
    outdir.claim("--output-dir", str(d), "vocab", overwrite=True)
    assert (sentinel / ".a.txt.tmp-1-0123abcd").read_text() == "someone else's\n"
    d2 = tmp_path / "out2"
    d2.mkdir()
    (d2 / "notes.txt").write_text("a person's notes\n")  # listed as a "temporary file" by hand
    (d2 / outdir.LEDGER).write_text(head + json.dumps(["notes.txt", ["t", 0, 0, 0, 0, ""]]) + "\n")
    with pytest.raises(UsageError, match="(malformed|unreadable) ownership record"):
        outdir.claim("--output-dir", str(d2), "vocab", overwrite=True)
    assert (d2 / "notes.txt").read_text() == "a person's notes\n"


def test_a_subfolder_swapped_for_a_link_after_its_check_is_never_written_through(tmp_path):
    d = tmp_path / "out"
    _claim(d)
    logs = outdir.make_dir(str(d / "logs"))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(logs, tmp_path / "moved")  # a race: the checked folder is swapped for a link mid-run
    os.symlink(outside, logs, target_is_directory=True)
    with pytest.raises(cli.RunError):
        outdir.open_append(os.path.join(logs, "metrics.jsonl"))
    with pytest.raises(OSError):
        outdir.new_temp(os.path.join(logs, "m.json"))
    assert os.listdir(outside) == []


def test_a_save_cut_short_keeps_only_what_speculators_did_not_write(tmp_path, caplog):
    """A save a kill cut short: what the record proves ours goes, and so do the files under speculators' save names
    (checkpoints.SAVE_FILES) in the folder the stage made for that save alone; a person's file there is kept, the folder
    moved aside with it. A folder of speculators' files only simply goes."""
    from eagle3pipe.train import checkpoints
    d = tmp_path / "ck"
    _claim(d, "train")
    staged = outdir.make_dir(str(d / ".saving"))
    staged = outdir.make_dir(os.path.join(staged, "2"))
    from eagle3pipe.storage import files
    files.write_json(os.path.join(staged, "training_state.json"), {"epoch": 2})  # recorded: ours
    with open(os.path.join(staged, "model.safetensors"), "wb") as f:  # speculators' half-written file: in no record
        f.write(b"\0" * 100)
    with open(os.path.join(staged, "my_analysis.py"), "w") as f:  # a person's
        f.write("print('mine')\n")
    checkpoints.discard_staged(staged)
    assert not os.path.exists(staged)
    aside = [n for n in os.listdir(d / ".saving") if n.startswith(".cut-short-2-")]
    assert len(aside) == 1 and "moved to" in caplog.text
    assert sorted(os.listdir(d / ".saving" / aside[0])) == ["my_analysis.py"]
    assert (d / ".saving" / aside[0] / "my_analysis.py").read_text() == "print('mine')\n"
    outdir.make_dir(staged)  # the name is free for the next save
    for name in ("model.safetensors", "optimizer_state_dict.pt"):  # a save cut short, nobody else's file in it
        with open(os.path.join(staged, name), "wb") as f:
            f.write(b"\0" * 100)
    checkpoints.discard_staged(staged)
    assert not os.path.exists(staged) and len(os.listdir(d / ".saving")) == 1


def test_only_an_engine_s_finished_files_are_cleared_from_a_spool(tmp_path):
    """A spool the stage made: the engine's files, told by their format, go; a person's file of the same suffix, a
    half-written one and anything else stay. A folder the stage did not make is never cleared."""
    import torch
    from eagle3pipe.formats import spool as engine_spool
    from eagle3pipe.formats.hidden_states import save
    d = tmp_path / "out"
    _claim(d, "train")
    spool = outdir.make_dir(str(d / ".online"))
    states = {"hidden_states": torch.zeros(3, 2, 4, dtype=torch.bfloat16), "token_ids": torch.tensor([1, 2, 3])}
    save(os.path.join(spool, "req-1.safetensors"), states)
    open(os.path.join(spool, "req-1.safetensors.lock"), "w").close()
    save(os.path.join(spool, "my_backup.safetensors"), {"weights": torch.zeros(2)})
    with open(os.path.join(spool, "req-2.safetensors"), "wb") as f:
        f.write(b"\x10\0\0\0\0\0\0\0{")  # cut short mid-write
    left = engine_spool.clear_spool(spool)
    assert left == ["my_backup.safetensors", "req-2.safetensors"] == sorted(os.listdir(spool))
    foreign = tmp_path / "engine-spool"
    foreign.mkdir()
    save(str(foreign / "hs_0.safetensors"), states)  # a stage 02 file, in a folder this stage did not make
    engine_spool.clear_spool(str(foreign))
    assert os.listdir(foreign) == ["hs_0.safetensors"]


def test_a_copied_log_of_a_killed_run_is_still_the_stage_s(tmp_path):
    """A log a killed run was appending to is recorded by its inode and its first bytes: a copy (cp -a) of the folder
    keeps it the stage's; a different file in its place is not."""
    import shutil
    d = tmp_path / "out"
    _claim(d)
    log_path = str(d / "run.log")
    fd = outdir.open_append(log_path)
    os.write(fd, b"first lines\n")
    os.close(fd)
    outdir.finish()  # that run ended normally
    fd = outdir.open_append(log_path)  # reopened by a later run, which is then killed: still recorded as growing
    os.write(fd, b"more\n")
    os.close(fd)
    outdir._growing.clear()  # killed: finish() never ran
    copy = tmp_path / "copy"
    shutil.copytree(d, copy, symlinks=True)
    led = outdir.Ledger.load(str(copy))
    assert led.entries["run.log"][0] == "g" and led.owns("run.log")
    (copy / "run.log").write_text("someone else's text\n")
    assert not outdir.Ledger.load(str(copy)).owns("run.log")


def test_a_copied_log_written_after_the_stage_finished_is_still_the_stage_s(tmp_path):
    """vLLM's engine processes and exit handlers write their shutdown lines to the engine's log after the stage has
    finished: a copy of the folder (cp -a) still holds the stage's log, and a file of other first bytes is not."""
    import shutil
    d = tmp_path / "out"
    _claim(d)
    log_path = str(d / "engine.log")
    fd = outdir.open_append(log_path, children_write=True)  # as engine_log.open_log opens it
    os.write(fd, b"==== the engine starts\n")
    lock = outdir.open_append(str(d / ".used.lock"), os.O_RDWR)  # a lock file: never written, always empty
    outdir.finish()  # the stage ends normally; the engine's processes still hold the file
    os.write(fd, b"[shutdown] EngineCore: exiting\n")
    os.close(fd)
    os.close(lock)
    copy = tmp_path / "copy"
    shutil.copytree(d, copy, symlinks=True)
    assert outdir.Ledger.load(str(copy)).owns("engine.log")
    assert outdir.Ledger.load(str(copy)).owns(".used.lock")
    (copy / "engine.log").write_text("==== someone else's file, and longer than the stage's\n")
    assert not outdir.Ledger.load(str(copy)).owns("engine.log")
    with open(d / "engine.log", "w") as f:  # rewritten from its start on the same inode: not the stage's log
        f.write("a person's notes, written over the log\n")
    assert not outdir.Ledger.load(str(d)).owns("engine.log")


def test_reading_the_record_reserves_what_it_holds_not_a_gib(tmp_path):
    """Each refresh read the record with read(1 << 30): a GiB of address space reserved, so under `ulimit -v` (as on
    many clusters) a stage failed at its end as out of memory. Under a 400 MiB limit it reads as it should."""
    import subprocess
    d = tmp_path / "out"
    _claim(d)
    from eagle3pipe.storage import files
    files.write_json(str(d / "a.json"), {"x": 1})
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (400 << 20, 400 << 20)); "
            "from eagle3pipe.storage import ledger; led = ledger.Ledger.load(sys.argv[1]); led.offset = 0; led.refresh(); "
            "print(led.owns('a.json'))")
    p = subprocess.run([sys.executable, "-c", code, str(d)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "True", p.stderr[-2000:]


def test_a_checkpoint_missing_a_file_the_stage_wrote_is_named_before_a_resume(tmp_path):
    """Speculators resumes from the newest epoch folder and fails on a missing file only after the model and the data
    have loaded: the file is named first, with the checkpoint to move away (two real trainings: tests/slow)."""
    from eagle3pipe.train import checkpoints
    from eagle3pipe.storage import files
    out = tmp_path / "draft"
    _claim(out, stage="train")
    outdir.make_dir(str(out / "0"))
    for name in ("config.json", "model.safetensors", "training_state.json"):
        files.write_json(str(out / "0" / name), {"stands for": name})
    checkpoints.resume_state(str(out))  # whole: nothing to say
    os.remove(out / "0" / "model.safetensors")
    with pytest.raises(UsageError, match=r"0/model.safetensors is gone \(deleted since this stage wrote it\), and "
                                         r"speculators would resume from 0: move 0 away"):
        checkpoints.resume_state(str(out))


def _verifier(folder, seed=0):
    """A small verifier folder as a stage reads it before anything loads: config.json and a safetensors file."""
    import json
    import torch
    from safetensors.torch import save_file
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64,
        "vocab_size": 256, "num_attention_heads": 4, "max_position_embeddings": 512}))
    g = torch.Generator().manual_seed(seed)
    save_file({f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 256, generator=g) for i in range(4)},
              str(folder / "model.safetensors"))
    return str(folder)


def test_weights_identify_a_verifier_beside_shapes_and_tokenizer(tmp_path):
    import shutil
    from eagle3pipe.verifier import verifier
    a = _verifier(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    w = b / "model.safetensors"
    data = bytearray(w.read_bytes())
    for i in range(len(data) // 2, len(data), 4096):  # half the tensors changed: a fine-tune of the same shapes
        data[i] ^= 0x40
    w.write_bytes(bytes(data))
    fa, fb, fc = (verifier.fingerprint(str(x)) for x in (a, b, tmp_path / "copy"))
    assert verifier.same_verifier(fa, fc) is None  # a copy is the same verifier
    assert verifier.same_verifier(fa, fb) == "weights_sha256"
    old = {k: v for k, v in fa.items() if k != "weights_sha256"}  # an output written before weights were recorded
    assert verifier.same_verifier(old, fb) is None


@pytest.mark.parametrize("ids", [[1, 2683.5], [1, True], [1, -1], [1, 49152], []])
def test_stage01_rows_are_integers_inside_the_vocabulary(tmp_path, ids):
    import json
    from eagle3pipe.storage.rows import read_rows
    (tmp_path / "tokenized_data.jsonl").write_text(json.dumps({"input_ids": ids, "loss_mask": [0] * len(ids)}) + "\n")
    with pytest.raises(UsageError, match="tokenized_data.jsonl:1: malformed row"):
        read_rows(str(tmp_path), 1, vocab_size=49152)


def test_stage01_rows_longer_or_shorter_than_their_manifest_says_are_refused(tmp_path):
    """Stage 02 checks --max-seq-len and plans memory by the manifest's longest row: a hand edit of either side
    (a row lengthened, the count lowered) ran rows past --max-seq-len with exit 0."""
    import json
    from eagle3pipe.storage.rows import read_rows
    rows = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    (tmp_path / "tokenized_data.jsonl").write_text("".join(json.dumps({"input_ids": r, "loss_mask": [1] * len(r)})
                                                           + "\n" for r in rows))
    assert len(read_rows(str(tmp_path), 3, longest=5)) == 3
    for said in (4, 100):
        with pytest.raises(UsageError, match=f"tokenized_data.jsonl: its longest row \\(line 2\\) has 5 tokens, its "
                                             f"manifest says {said}; rerun 01_prepare_dataset.py"):
            read_rows(str(tmp_path), 3, longest=said)


def test_the_validation_split_leaves_rows_on_both_sides():
    from eagle3pipe.train import train_data
    train_data.check_split(24, 0.05)
    for rows, ratio in ((6, 0.99), (1, 0.5), (100, 1e-17)):
        with pytest.raises(UsageError, match=f"--val-ratio {ratio}: of {rows} rows"):
            train_data.check_split(rows, ratio)
    # rows stage 02 could not extract: each side needs one it did (24 rows at 0.05: 22 to train, 2 to validate)
    train_data.check_split(24, 0.05, failed=set(range(21)) | {22}, hidden_states="hs")
    with pytest.raises(UsageError, match="--hidden-states hs: stage 02 extracted none of the 22 training rows "
                                         r"\(rows 0-21 all failed"):
        train_data.check_split(24, 0.05, failed=set(range(22)), hidden_states="hs")
    with pytest.raises(UsageError, match="none of the 2 validation rows"):
        train_data.check_split(24, 0.05, failed={22, 23}, hidden_states="hs")


def test_an_engine_spool_is_never_a_stage_s_folder_or_inside_this_run_s(tmp_path):
    """The files an engine at --engine-address hands back are deleted once read: its --engine-spool may not be a
    stage's output folder, or hold or sit inside this run's folders; and it is never cleared wholesale."""
    import http.server
    import json
    import threading
    from eagle3pipe.train import online_plan
    from eagle3pipe.verifier import verifier

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": model_path}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    model_path = _verifier(tmp_path / "model")
    srv = http.server.HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    fp, tc = verifier.open_verifier(model_path, False)
    out, stage02 = tmp_path / "run" / "ck", tmp_path / "hs"
    _claim(stage02, "extract")
    (tmp_path / "spool").mkdir()
    (tmp_path / "run").mkdir()
    try:
        for spool, needle in ((stage02, "holds a pipeline stage's output"), (tmp_path / "run", "holds or sits inside --output-dir")):
            s = record(settings.Train, online=True, engine_address=f"127.0.0.1:{srv.server_port}", model_path=model_path,
                       engine_spool=str(spool), output_dir=str(out))
            with pytest.raises(UsageError, match=needle):
                online_plan.plan(s, fp, tc, 100, [2, 15, 27, 30])
        s = record(settings.Train, online=True, engine_address=f"127.0.0.1:{srv.server_port}", model_path=model_path,
                   engine_spool=str(tmp_path / "spool"), output_dir=str(out))
        assert online_plan.plan(s, fp, tc, 100, [2, 15, 27, 30]).spool == str(tmp_path / "spool")
    finally:
        srv.shutdown()


def test_checkpoint_best_follows_the_expected_acceptance_not_the_loss(tmp_path):
    import json
    """Late in training the loss can keep falling while acceptance falls: epoch 1 has the lower loss, epoch 0 the
    higher acceptance (1 + a1 + a1*a2 + ...), and checkpoint_best stays on epoch 0, through the stage's trainer."""
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from eagle3pipe.measures import acceptance
    from eagle3pipe.train import checkpoints, training
    d = tmp_path / "ck"
    _claim(d, "train")
    from eagle3pipe.storage import files
    for e in ("0", "1", "2"):
        outdir.make_dir(str(d / e))
        if e != "2":  # epoch 2 saved no checkpoint: it cannot become best
            files.write_json(str(d / e / "config.json"), {})

    class Config:
        checkpoint_freq = 1.0
    cls = training.make_trainer_class(None, True, None)
    t = cls.__new__(cls)  # the stage's trainer class, with only what maybe_update_best reads
    t.rank, t.config, t.best_val_loss, t.checkpointer = 0, Config(), float("inf"), SingleGPUCheckpointer(d)
    epochs = [{"loss_epoch": 9.7, "full_acc_0_epoch": 0.40, "full_acc_1_epoch": 0.12, "full_acc_2_epoch": 0.04},
              {"loss_epoch": 9.1, "full_acc_0_epoch": 0.35, "full_acc_1_epoch": 0.10, "full_acc_2_epoch": 0.03}]
    for e, m in enumerate(epochs):
        t.maybe_update_best(e, m)
    assert os.readlink(d / "checkpoint_best") == "0" and t.best_val_loss == 9.7
    assert checkpoints.best_acceptance(d) == acceptance.expected_acceptance(epochs[0]) == 1.56
    assert outdir.owned(str(d / "checkpoint_best")) and outdir.owned(str(d / "0" / "val_metrics.json"))
    assert json.load(open(d / "1" / "val_metrics.json"))["expected_acceptance_length"] == 1.48  # every epoch's
    t.maybe_update_best(2, {**epochs[1], "full_acc_0_epoch": 0.9})
    assert os.readlink(d / "checkpoint_best") == "0" and not (d / "2" / "val_metrics.json").exists()
    t.maybe_update_best(1, {**epochs[1], "full_acc_0_epoch": 0.6})  # now epoch 1 accepts more: it becomes best
    assert os.readlink(d / "checkpoint_best") == "1"


def test_a_replica_that_found_no_record_reads_the_one_another_replica_made(tmp_path, monkeypatch):
    """--shard replicas start together: one may look for the shared record just before the other makes it."""
    import subprocess
    import sys
    d = tmp_path / "out"
    d.mkdir()
    other = ("import sys; from eagle3pipe.storage import outdir, files; outdir.claim('--output-dir', sys.argv[1], 'extract', "
             "shard=(1, 2)); files.write_json(sys.argv[1] + '/b.json', {'x': 1})")
    load = outdir.Ledger.load

    def late(root):  # the fault: this replica's look comes before the other's record, its check after it
        if sys._getframe(1).f_code.co_name == "claim" and not (d / outdir.LEDGER).exists():
            subprocess.run([sys.executable, "-c", other, str(d)], cwd=REPO, check=True)
            return None
        return load(root)
    monkeypatch.setattr(outdir.Ledger, "load", late)
    _claim(d, "extract", shard=(0, 2))
    monkeypatch.undo()
    assert outdir.owned(str(d / "b.json"))  # the other replica's file: installing over it is not a stranger's


def test_a_measure_that_fails_leaves_checkpoint_best_to_the_estimate(tmp_path, caplog):
    """The acceptance measure is an addition: its verifier failing to load (here: a folder with no model) is one
    warning, not a failed run; checkpoint_best then follows the trainer's estimate, and the measure is not tried
    again at later epochs."""
    import json
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from eagle3pipe.storage import files
    from eagle3pipe.train import training
    from eagle3pipe.train.validation_measure import Measure
    d = tmp_path / "ck"
    _claim(d, "train")
    for e in ("0", "1"):
        outdir.make_dir(str(d / e))
        files.write_json(str(d / e / "config.json"), {})
    (tmp_path / "no-model").mkdir()
    measure = Measure(str(tmp_path / "no-model"), [2], [[1, 2, 3]], 3, 4, "cpu")

    class Config:
        checkpoint_freq = 1.0
    cls = training.make_trainer_class(None, True, None, measure)
    t = cls.__new__(cls)
    t.rank, t.config, t.best_val_loss, t.checkpointer = 0, Config(), float("inf"), SingleGPUCheckpointer(d)
    t.model = None
    with caplog.at_level("WARNING", logger="eagle3"):
        t.maybe_update_best(0, {"loss_epoch": 9.7, "full_acc_0_epoch": 0.30})
        t.maybe_update_best(1, {"loss_epoch": 9.1, "full_acc_0_epoch": 0.40})
    warned = [r.getMessage() for r in caplog.records if "acceptance measure failed" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint_best follows the trainer's estimate" in warned[0], warned
    assert measure.failed and os.readlink(d / "checkpoint_best") == "1"
    assert "acceptance_measure" not in json.load(open(d / "1" / "val_metrics.json"))


def test_prompts_that_leave_no_room_for_an_answer_are_refused_by_their_tokens():
    """Stage 05's max_model_len from the longest prompt's tokens: a prompt the verifier's positions cannot answer at
    all names its record; one that --max-new-tokens pushes past them names that flag and the most it can be."""
    from types import SimpleNamespace
    from eagle3pipe.measures import draft_check
    args = SimpleNamespace(num_speculative_tokens=3, max_new_tokens=100, prompts="p.jsonl")
    assert draft_check.max_model_len(1000, args, 8192, "p.jsonl:1") == 1000 + 100 + 3 + 8
    assert draft_check.max_model_len(8085, args, 8192, "p.jsonl:1") == 8192  # never past the verifier's own
    with pytest.raises(UsageError, match=r"--prompts p.jsonl:2: a prompt of 8189 tokens; with --num-speculative-tokens"
                                         r" 3 the verifier's 8192 positions leave no room for an answer"):
        draft_check.max_model_len(8189, args, 8192, "p.jsonl:2")
    with pytest.raises(UsageError, match=r"--max-new-tokens 100: the longest prompt \(8100 tokens\) .* lower "
                                         r"--max-new-tokens to at most 89, .*\(the longest: p.jsonl:3\)"):
        draft_check.max_model_len(8100, args, 8192, "p.jsonl:3")
    assert draft_check.max_model_len(50, args, None) == 50 + 100 + 3 + 8  # no positions in the config: vLLM's call


def test_a_list_of_layer_ids_with_an_empty_item_is_refused_not_shortened():
    import argparse
    assert cli.int_list("2,15,27") == cli.int_list("2 15 27") == cli.int_list(" 2, 15 ,27 ") == [2, 15, 27]
    for typo in ("2,,15", "2,15,", ",2", "", ","):  # "2,,15" was read as [2, 15]: a layer dropped in silence
        with pytest.raises(argparse.ArgumentTypeError, match="expected integers separated by commas"):
            cli.int_list(typo)


def test_a_check_about_two_settings_names_each_as_the_operator_gave_it():
    """A contradiction between two config keys named one of them as a flag nobody typed."""
    err = UsageError("--norm-before-fc and --fc-norm: one norm before the FC projection or the other, not both "
                     "(--fc-norm alone turns the first off)")
    origin = {"norm_before_fc": "train.norm_before_fc", "fc_norm": "train.fc_norm"}
    both = cli._named_by_config(err, {"norm_before_fc", "fc_norm"}, "c.yaml", origin)
    assert str(both) == ("--config c.yaml: key 'train.norm_before_fc' and key 'train.fc_norm': one norm before the "
                         "FC projection or the other, not both (--fc-norm alone turns the first off)")
    one = cli._named_by_config(err, {"norm_before_fc"}, "c.yaml", origin)  # --fc-norm typed: named as typed
    assert str(one).startswith("--config c.yaml: key 'train.norm_before_fc' and --fc-norm: one norm")
    assert cli._named_by_config(err, set(), "c.yaml", origin) is err
    lr = cli._named_by_config(UsageError("--lr -1.0: must be greater than 0"), {"lr"}, "c.yaml", {"lr": "train.lr"})
    assert str(lr) == "--config c.yaml: key 'train.lr' -1.0: must be greater than 0"
    # a flag whose name another's begins with is not touched
    assert cli._named_by_config(UsageError("--lr-x 1: no"), {"lr"}, "c.yaml", {"lr": "lr"}).args[0] == "--lr-x 1: no"


def test_stage05_says_whether_the_draft_pays_for_itself_here():
    """The last line of stage 05's table (and so of the CPU quickstart): the speed-up at batch 1 and at the largest
    batch, and what the acceptance bought; a draft slower than the verifier alone is said to be so (a tried
    quickstart's draft ran 0.95x at batch 1 and 0.60x at batch 4, and its last lines did not say)."""
    from eagle3pipe.evaluate.eval_report import verdict
    slow = verdict({"speedup": {1: 0.95, 4: 0.6}, "acceptance_length": 1.18}, 3)
    assert slow.startswith("verdict: the draft does not pay for itself here (0.95x at batch 1, 0.60x at batch 4)")
    assert "yields 1.18 tokens" in slow
    fast = verdict({"speedup": {"1": 1.39}, "acceptance_length": 2.43}, 3)  # as report.json holds it
    assert fast.startswith("verdict: the draft pays for itself here (1.39x at batch 1)") and "2.43" in fast

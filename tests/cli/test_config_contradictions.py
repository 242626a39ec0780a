"""A setting that the others make meaningless is refused in one line naming both sides, before anything loads, when
the operator asked for it: on the command line, or in the stage's own section of a config beside the explicit flag
that voids it. Two keys of one config are accepted, and so is a top-level key an explicit flag voids for this stage
(a config's top level is shared by every stage: flags win)."""
import pytest

from conftest import assert_refused, run_script

MODEL = "data/models/smollm2-135m-instruct"


@pytest.mark.parametrize("script,config,argv,needles", [
    ("04_train.py", "online: true\ncache_gb: 1\n", ["--hidden-states", "{t}/hs"],
     ["--hidden-states {t}/hs contradicts 'online: true' in --config {t}/c.yaml", "offline training reads"]),
    ("04_train.py", "", ["--online", "--hidden-states", "{t}/hs"], ["--hidden-states {t}/hs contradicts --online"]),
    ("04_train.py", "", ["--backend", "hf"], ["--backend hf: only with --online"]),
    ("04_train.py", "online: false\n", ["--engine-timeout", "30"],
     ["--engine-timeout 30 contradicts 'online: false' in --config {t}/c.yaml"]),
    ("02_extract_hidden_states.py", "extract:\n  tp_size: 8\n", ["--backend", "hf", "--dry-run"],
     ["'extract.tp_size: 8' in --config {t}/c.yaml contradicts --backend hf", "remove the key, or drop --backend"]),
    # the stage's own section asked for the states it reads; --online generates them instead
    ("04_train.py", "train:\n  hidden_states: {t}/hs\n", ["--online"],
     ["'train.hidden_states: {t}/hs' in --config {t}/c.yaml contradicts --online", "remove the key, or drop --online"]),
    ("02_extract_hidden_states.py", "backend: hf\n", ["--tp-size", "2", "--dry-run"],
     ["--tp-size 2 contradicts 'backend: hf' in --config {t}/c.yaml", "no tensor parallelism"]),
    ("02_extract_hidden_states.py", "backend: hf\n", ["--gpu-memory-utilization", "0.5", "--dry-run"],
     ["--gpu-memory-utilization 0.5 contradicts 'backend: hf'"]),
    ("01_prepare_dataset.py", "", ["--regen-temperature", "0.5"], ["--regen-temperature 0.5: only with --regenerate"]),
    ("01_prepare_dataset.py", "", ["--dtype", "bfloat16"], ["--dtype bfloat16: only with --regenerate"]),
    # a split is a hub dataset's: beside a local file it was recorded in the manifest and never used
    ("01_prepare_dataset.py", "", ["--dataset", "README.md", "--split", "validation"],
     ["--split validation contradicts --dataset README.md", "a split is a hub dataset's"]),
    ("04_train.py", "", ["--fsdp", "--measure-prompts", "8"],
     ["--measure-prompts 8 contradicts --fsdp", "the measure runs a whole draft on one"]),
    # speculators builds no scheduler for `none`: a warmup beside it was dropped in silence (trained, exit 0)
    ("04_train.py", "", ["--scheduler", "none", "--warmup-steps", "3"],
     ["--warmup-steps 3 contradicts --scheduler none", "no warmup"]),
    ("04_train.py", "scheduler: none\n", ["--warmup-steps", "3"],
     ["--warmup-steps 3 contradicts 'scheduler: none' in --config {t}/c.yaml"]),
    ("04_train.py", "warmup_steps: 3\n", ["--scheduler", "none"],
     ["'warmup_steps: 3' in --config {t}/c.yaml contradicts --scheduler none"]),
    ("04_train.py", "", ["--ttt-steps", "1", "--ttt-step-loss-decay", "0.8"],
     ["--ttt-step-loss-decay 0.8 contradicts --ttt-steps 1", "one TTT step"]),
    ("04_train.py", "", ["--measure-prompts", "0", "--measure-tokens", "32"],
     ["--measure-tokens 32 contradicts --measure-prompts 0", "the trainer's estimate chooses checkpoint_best"]),
])
def test_a_flag_the_settings_ignore_is_refused_naming_both(tmp_path, script, config, argv, needles):
    (tmp_path / "c.yaml").write_text(f"model_path: {MODEL}\n" + config.format(t=tmp_path))
    argv = [a.format(t=tmp_path) for a in argv]
    p, secs = run_script(script, "--config", str(tmp_path / "c.yaml"), *argv, "--output-dir", str(tmp_path / "out"))
    assert_refused(p, secs, *[n.format(t=tmp_path) for n in needles])
    assert not (tmp_path / "out").exists()


def test_keys_of_one_config_voiding_each_other_are_accepted(tmp_path):
    """A config's top-level `backend: hf` serves stage 02; stage 04 trains offline from the same config and ignores
    it: the settings pass, and stage 04 goes on to check its inputs."""
    (tmp_path / "c.yaml").write_text(f"model_path: {MODEL}\nbackend: hf\nprepared_data: {tmp_path}/none\n")
    p, secs = run_script("04_train.py", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "out"))
    assert_refused(p, secs, f"key 'prepared_data' {tmp_path}/none: folder not found")


@pytest.mark.parametrize("script,config,argv", [
    # the shipped configs' top-level hidden_states is stage 02's output: `04_train.py --config ... --online`, the
    # documented command, was refused, and so was the advice it gave (--hidden-states beside --online)
    ("04_train.py", "hidden_states: {t}/hs\n", ["--online"]),
    # the Kimi config's tp_size serves stage 05 too; stage 02 on a CPU runs --backend hf
    ("02_extract_hidden_states.py", "tp_size: 8\n", ["--backend", "hf", "--dry-run"]),
    # likewise its gpu_memory_utilization, stage 05's engine's too: the shipped Kimi and Llama configs were refused
    ("02_extract_hidden_states.py", "gpu_memory_utilization: 0.85\n", ["--backend", "hf", "--dry-run"]),
])
def test_a_top_level_key_an_explicit_flag_voids_gives_way(tmp_path, script, config, argv):
    (tmp_path / "c.yaml").write_text(f"model_path: {MODEL}\nprepared_data: {tmp_path}/none\n"
                                     + config.format(t=tmp_path))
    p, secs = run_script(script, "--config", str(tmp_path / "c.yaml"), *argv, "--output-dir", str(tmp_path / "out"))
    assert_refused(p, secs, f"key 'prepared_data' {tmp_path}/none: folder not found")  # past the settings
    assert "contradicts" not in p.stderr


@pytest.mark.parametrize("script,config,typed,says", [
    # checked against the verifier after the settings: it was named as a flag nobody typed
    ("03_build_vocab_mapping.py", "draft_vocab_size: 100000\n", [],
     "--config {t}/c.yaml: key 'draft_vocab_size' 100000: must be between 1 and the verifier vocab size 49152"),
    # a section's key is named with its section: where the operator finds it in the file
    ("03_build_vocab_mapping.py", "vocab:\n  draft_vocab_size: 100000\n", [],
     "--config {t}/c.yaml: key 'vocab.draft_vocab_size' 100000: must be between 1"),
    ("03_build_vocab_mapping.py", "draft_vocab_size: 8192\n", ["--draft-vocab-size", "100000"],
     "--draft-vocab-size 100000: must be between 1"),  # typed: named as typed
])
def test_a_later_check_names_a_config_value_by_its_key(tmp_path, stages, script, config, typed, says):
    (tmp_path / "c.yaml").write_text(f"model_path: {MODEL}\n" + config)
    p, secs = run_script(script, "--config", str(tmp_path / "c.yaml"), "--prepared-data", str(stages["prepared"]),
                         *typed, "--output-dir", str(tmp_path / "out"))
    assert_refused(p, secs, says.format(t=tmp_path))
    assert not (tmp_path / "out").exists()

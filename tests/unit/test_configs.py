"""Every shipped config loads through every script's parser, and explicit flags win over it."""
import dataclasses
import glob
import os

import pytest

from conftest import REPO, load_script
from eagle3pipe.config import cli


CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "0*_*.py")))


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_config_through_every_parser(script, config):
    import yaml
    args = load_script(script).parse_args(["--config", config])
    cfg = yaml.safe_load(open(config))
    assert getattr(args, "model_path", cfg["model_path"]) == cfg["model_path"]


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_config_takes_either_extraction_backend(config):
    """A shipped config's vLLM settings (`gpu_memory_utilization`, `tp_size`) serve stage 05's engine too, so
    `--backend hf` beside them (stage 02 on a machine without vLLM's GPU build) gives way instead of asking the
    operator to edit the file; stage 05 takes the same values."""
    import yaml
    extract = load_script("02_extract_hidden_states.py")
    for backend in ("hf", "vllm"):
        assert extract.parse_args(["--config", config, "--backend", backend]).backend == backend
    cfg = yaml.safe_load(open(config))
    evaluate = load_script("05_evaluate.py").parse_args(["--config", config])
    assert evaluate.gpu_memory_utilization == cfg.get("gpu_memory_utilization", 0.9)
    assert evaluate.tp_size == cfg.get("tp_size", 1)


def test_flags_win_over_config():
    cfg = os.path.join(REPO, "configs", "smollm2-135m.yaml")
    mod = load_script("01_prepare_dataset.py")
    assert mod.parse_args(["--config", cfg]).num_samples == 300       # from the prepare: section
    assert mod.parse_args(["--config", cfg]).output_dir == "data/prepared"  # prepared_data -> --output-dir
    assert mod.parse_args(["--config", cfg, "--num-samples", "7"]).num_samples == 7


STAGE_OF = {"01_prepare_dataset.py": "prepare", "02_extract_hidden_states.py": "extract",
            "03_build_vocab_mapping.py": "vocab", "04_train.py": "train", "05_evaluate.py": "evaluate"}


def test_every_script_flag_is_a_record_field_and_a_config_key():
    """Every flag lands in the stage's typed record, and any flag can be put in a config file (except --config and
    the switches of one run)."""
    from eagle3pipe.config import settings
    local = {"config", "help"} | settings.RUN_ONLY
    for script in SCRIPTS:
        mod = load_script(script)
        parser_dests = set()
        orig = cli.parse_args

        def capture(p, *a, **k):
            parser_dests.update(x.dest for x in p._actions)
            raise SystemExit(0)
        cli.parse_args = capture
        try:
            with pytest.raises(SystemExit):
                mod.parse_args([])
        finally:
            cli.parse_args = orig
        stage = STAGE_OF[script]
        fields = {f.name for f in dataclasses.fields(settings.RECORDS[stage])}
        assert parser_dests - {"config", "help"} == fields, script
        missing = parser_dests - local - set(settings.config_keys(stage))
        assert not missing, f"{script}: flags without a config key: {missing}"


@pytest.mark.parametrize("written,value", [("off", "off"), ("on", "on"), ("'off'", "off"), ("no", "off"),
                                           ("auto", "auto")])
def test_a_bare_on_or_off_in_a_config_means_the_word(tmp_path, written, value):
    # YAML 1.1 reads a bare on/off (yes/no) as a boolean; a key whose choices are those words takes it as the word
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"evaluate:\n  measure: {written}\n")
    assert cli.load_config(str(cfg), "evaluate")["measure"] == value
    cfg.write_text("evaluate:\n  measure: 3\n")
    with pytest.raises(cli.UsageError, match="key 'evaluate.measure' must be"):
        cli.load_config(str(cfg), "evaluate")


@pytest.mark.parametrize("text,key", [("vocab_mapping: ''\n", "vocab_mapping"), ("vocab:\n  prepared_data: ' '\n",
                                                                                  "vocab.prepared_data")])
def test_an_empty_path_in_a_config_is_named_by_its_key(tmp_path, text, key):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(cli.UsageError, match=f"--config {cfg}: key '{key}' is empty; give a value"):
        cli.load_config(str(cfg), "vocab")


@pytest.mark.parametrize("written,value", [("3e-3", 3e-3), ("3.0e-3", 3e-3), ("1E-4", 1e-4), ("0.003", 3e-3)])
def test_a_float_in_exponent_notation_is_a_number_in_a_config(tmp_path, written, value):
    # YAML 1.1 reads 3e-3 (no dot) as the string '3e-3'; --lr 3e-3 is a number, and so is the config's
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"train:\n  lr: {written}\n")
    assert cli.load_config(str(cfg), "train")["lr"] == pytest.approx(value)
    cfg.write_text("train:\n  lr: fast\n")
    with pytest.raises(cli.UsageError, match="key 'train.lr' must be a number"):
        cli.load_config(str(cfg), "train")


@pytest.mark.parametrize("text,key", [("layer_ids: []\n", "layer_ids"), ("evaluate:\n  draft: []\n", "evaluate.draft")])
def test_an_empty_list_in_a_config_is_refused_not_read_as_the_default(tmp_path, text, key):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(cli.UsageError, match=f"key '{key}' is an empty list"):
        cli.load_config(str(cfg), "extract")


def test_a_bad_value_from_a_config_is_named_by_its_key_not_by_a_flag(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_path: {os.path.join(REPO, 'data/models/smollm2-135m-instruct')}\ntrain:\n  device: CPU\n")
    mod = load_script("04_train.py")
    with pytest.raises(cli.UsageError, match=f"^--config {cfg}: key 'train.device' 'CPU'"):  # with its section
        mod.parse_args(["--config", str(cfg)])
    with pytest.raises(cli.UsageError, match="^--warmup-steps -5: must be at least 0"):  # typed: named by its flag
        mod.parse_args(["--config", str(cfg), "--device", "cpu", "--warmup-steps", "-5"])

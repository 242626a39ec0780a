"""Every shipped config loads through every script's parser, and explicit flags win over it."""
import glob
import os

import pytest

from conftest import REPO, load_script
from eagle3pipe import cli

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "0*_*.py")))


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_config_through_every_parser(script, config):
    args = load_script(script).parse_args(["--config", config])
    assert args.config == config


def test_flags_win_over_config():
    cfg = os.path.join(REPO, "configs", "smollm2-135m.yaml")
    mod = load_script("01_prepare_dataset.py")
    assert mod.parse_args(["--config", cfg]).num_samples == 300       # from the prepare: section
    assert mod.parse_args(["--config", cfg]).output_dir == "data/prepared"  # prepared_data -> --output-dir
    assert mod.parse_args(["--config", cfg, "--num-samples", "7"]).num_samples == 7


def test_every_script_flag_is_a_config_key():
    """So any flag can be put in a config file (except --config and stage-local output/dry-run switches)."""
    local = {"config", "help", "output_dir", "dry_run", "overwrite", "resume", "verify", "shard"}
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
        missing = parser_dests - local - set(cli.CONFIG_KEYS)
        assert not missing, f"{script}: flags without a config key: {missing}"

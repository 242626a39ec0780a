"""Stage 01 --regenerate with sampling on CPU over real ShareGPT rows."""
import json

from conftest import run_script


# a regression run over 40 real conversations; e2e/test_regenerate.py's kill and resume keeps --regenerate in CI
def test_regenerate_samples_on_cpu_over_real_sharegpt(model_path, tmp_path):
    """Sampling (temperature > 0) on 40 real ShareGPT conversations: their long prompts are prefilled in chunks,
    and per-request seeds made vLLM's CPU engine die ("CPU Generator does not use offset"). Split ShareGPT parts
    that open with an assistant turn are dropped and counted."""
    out = tmp_path / "prep"
    p, _ = run_script("01_prepare_dataset.py", "--model-path", model_path, "--num-samples", "40", "--output-dir",
                      str(out), "--regenerate", "--regen-temperature", "0.7", "--regen-max-tokens", "4")
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.load(open(out / "manifest.json"))["regenerated"]
    assert m["settings"]["temperature"] == 0.7 and m["turns_regenerated"] > 40 and m["opening_turns_dropped"] > 0
    assert len(open(out / "regenerated.jsonl").readlines()) == m["turns_regenerated"]

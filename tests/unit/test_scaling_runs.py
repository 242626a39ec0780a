"""The scaling bench's run specs (bench/bench_scaling_quality.py): every spec is checked before any run starts, and
two specs that would train into one folder are refused (a 6-epoch and a 3-epoch run once shared one)."""
import pytest

from bench.bench_scaling_quality import plan_runs


def test_runs_that_share_a_folder_are_refused_before_any_starts(tmp_path):
    (tmp_path / "vocab32768").mkdir()
    (tmp_path / "vocab32768" / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        plan_runs(str(tmp_path), ["all:6:0:32768:v32768+L2", "all:3:0:32768:v32768+L2"])
    assert "both train into ck/nall-s0-t32768-v32768-L2" in str(e.value)
    assert "all:3:0:32768:v32768+L2+e3" in str(e.value)  # the way out it names is a valid spec
    plans = plan_runs(str(tmp_path), ["all:6:0:32768:v32768+L2+e6", "all:3:0:32768:v32768+L2+e3"])
    assert [p[0] for p in plans] == ["nall-s0-t32768-v32768-L2-e6", "nall-s0-t32768-v32768-L2-e3"]
    assert plans[0][5] == ["--vocab-mapping", f"{tmp_path}/vocab32768", "--num-layers", "2"]


def test_a_bad_lever_is_refused_before_any_run_starts(tmp_path):
    with pytest.raises(SystemExit, match="lever 'v16384'"):  # no W/vocab16384: refused, though the first spec is fine
        plan_runs(str(tmp_path), ["300:2:0", "all:3:0:8192:v16384"])
    with pytest.raises(SystemExit, match="lever 'e4'"):  # an epoch count in the name that is not the run's
        plan_runs(str(tmp_path), ["all:3:0::e4"])
    assert plan_runs(str(tmp_path), ["all:3:0::e3"])[0][:5] == ("nall-s0-e3", "all", "3", "0", "")


def test_the_paired_difference_and_its_band():
    from bench.bench_scaling_quality import paired
    a = [[10, 12], [8, 4], [12, 20], [5, 5]]  # per prompt: [drafts, accepted]
    assert paired(a, a) == (0.0, 0.0, 0.0)  # one draft against itself: no difference, no band
    b = [[d, x + 2] for d, x in a]  # two more accepted on every prompt
    d, lo, hi = paired(a, b)
    assert abs(d - 8 / 35) < 1e-12 and 0 < lo <= d <= hi  # 1 + 49/35 - (1 + 41/35); every resample gains

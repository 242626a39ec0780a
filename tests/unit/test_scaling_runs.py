"""The scaling bench's run specs (bench/bench_scaling_quality.py): every spec is checked before any run starts, and
two specs that would train into one folder are refused (a 6-epoch and a 3-epoch run once shared one); comparisons
pool seeds prompt by prompt."""
import json
import sys

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


def test_two_seeds_pool_prompt_by_prompt_and_differing_references_are_named(capsys, tmp_path):
    from bench.bench_scaling_quality import compare, pooled
    rec = lambda per, refs=None: {"k3": {"per_prompt": per, "acceptance_length": 0.0}, **({"refs": refs} if refs else {})}
    m = {"a/0": rec([[10, 10], [10, 0]], "r1"), "a/1": rec([[10, 20], [30, 0]], "r1"),
         "b/0": rec([[10, 12], [10, 2]], "r2")}
    per, length, refs = pooled(m, "a/0+a/1")
    assert per == [[20, 30], [40, 0]] and length == 1 + 30 / 60 and refs == {"r1"}  # summed, not averaged per prompt
    src = tmp_path / "m.json"
    src.write_text(json.dumps(m))
    compare([str(src)], ["a/0:b/0"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("b/0 - a/0: k3 1.7000 - 1.5000 = +0.2000") and line.endswith("references differ between runs")
    compare([str(src)], ["a/0:a/1"])
    assert "references differ" not in capsys.readouterr().out


def test_compare_reads_the_k_the_command_line_names(tmp_path, monkeypatch, capsys):
    """`compare --k 5` compares the k=5 figures of the same records; --k 4 is refused by argparse."""
    from bench.bench_scaling_quality import main
    rec = lambda k3, k5: {"k3": {"per_prompt": k3, "acceptance_length": 0.0},
                          "k5": {"per_prompt": k5, "acceptance_length": 0.0}}
    src = tmp_path / "m.json"
    src.write_text(json.dumps({"a/0": rec([[10, 10]], [[10, 20]]), "b/0": rec([[10, 10]], [[10, 30]])}))
    argv = ["bench_scaling_quality", "compare", "--work", str(tmp_path), "--src", str(src), "--runs", "a/0:b/0"]
    monkeypatch.setattr(sys, "argv", argv + ["--k", "5"])
    main()
    assert capsys.readouterr().out.startswith("b/0 - a/0: k5 4.0000 - 3.0000 = +1.0000")  # k=3 would read 2 - 2
    monkeypatch.setattr(sys, "argv", argv + ["--k", "4"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2

"""No process outlives a killed stage (eagle3pipe/base/lifeline.py), through the real entry points: stage 05 (vLLM's LLM
in its own process, which spawns the EngineCore) and stage 04 --online with the HF engine (a server it starts),
SIGKILLed at points of the engine's start and after, and stage 04 once a step has trained on batches from loader
workers forked by its fork server; every process the stage started is gone within a bounded wait
(conftest.killed_at). The cheapest case (stage 04's engine killed while it loads) is in the default set:
tests/reliability/test_lifeline.py."""
import pytest

from conftest import killed_at, online_args, train_args


@pytest.mark.parametrize("point", ["lifeline", "engine-core", "worker", "vllm-ready"])
def test_stage05_killed_while_its_engine_starts_leaves_nothing(point, stages, trained, model_path, tmp_path):
    out, _ = trained
    argv = ["05_evaluate.py", "--model-path", model_path, "--draft", str(out / "last"), "--prepared-data",
            str(stages["prepared"]), "--output-dir", str(tmp_path / "ev"), "--num-prompts", "2", "--max-new-tokens",
            "8", "--batch-sizes", "1"]
    assert killed_at(argv, point, tmp_path) == []


@pytest.mark.parametrize("point, term_first", [("hf-loading", True), ("hf-ready", False), ("step", False)])
def test_stage04_online_killed_while_its_engine_starts_leaves_nothing(point, term_first, small, model_path, tmp_path):
    argv = online_args(model_path, small, tmp_path / "draft", "--backend", "hf", "--epochs", "2")
    assert killed_at(argv, point, tmp_path, term_first) == []


def test_stage04_killed_while_training_leaves_no_loader_worker(stages, model_path, tmp_path):
    """Stage 04's data-loader workers fork from a server it starts (warm_start.WorkerServer), so they are not its
    children: SIGKILLed once a step has trained on their batches, it leaves neither the server nor a worker."""
    argv = train_args(model_path, stages, tmp_path / "draft", "--num-workers", "1", "--epochs", "3")
    assert killed_at(argv, "worker-server", tmp_path) == []

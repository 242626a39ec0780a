"""Stage 04 --profile-steps N: where a training step's time goes, for an operator who sees a low MFU in the dense log.

torch.profiler records N steps (CPU and, on a GPU, CUDA time per operator) once the first SKIP steps are done (the
first compiles the draft's step and waits for the loaders' start), on rank 0 only. Steps are counted at the training
loader: each batch handed to the trainer starts the next one. When the N steps are recorded the run goes on
unprofiled, and two files are written into the run's logs/ (each whole, or not at all):
    profile.txt          the operators that took the time, most first (self time on the device that ran them),
                         then the ranges that hold them (an optimizer's step, a compiled region) by their total time
    profile_trace.json   the timeline, for chrome://tracing or https://ui.perfetto.dev
and one log line names them. Nothing else changes: a profiled run trains what an unprofiled one trains.
"""
import logging
import os

from ..storage import files

log = logging.getLogger("eagle3")
SKIP = 5  # steps before the profile: the first one compiles, the loaders are starting
ROWS = 40  # operators in profile.txt
SPANS = 25  # rows of its second table, by the total time under each


class StepProfile:
    """A per-batch step for input_watch.BatchGuard: `__call__(batch)` marks a step boundary and returns the batch."""

    def __init__(self, steps, logs, on_gpu):
        self.steps, self.logs, self.on_gpu, self.seen, self.prof = steps, logs, on_gpu, 0, None

    def __call__(self, batch):
        self.seen += 1
        if self.seen == SKIP + 1:
            self._start()
        elif self.prof is not None:
            self.prof.step()
            if self.seen == SKIP + 1 + self.steps:
                self._finish()
        return batch

    def _start(self):
        import torch
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
        self.prof = profile(activities=activities)
        if self.on_gpu:
            torch.cuda.synchronize()  # the steps before are not in it
        self.prof.start()

    def _finish(self):
        import torch
        if self.on_gpu:
            torch.cuda.synchronize()  # the last step's queued GPU work is in it
        prof, self.prof = self.prof, None
        prof.stop()
        device = "cuda" if self.on_gpu else "cpu"
        events = prof.key_averages()
        table = events.table(sort_by=f"self_{device}_time_total", row_limit=ROWS)
        # the ranges, each with what ran inside it: the optimizers' steps (torch names them Optimizer.step#Muon.step),
        # the compiled regions, forward and backward; a range's own self time is near zero, so the first table
        # misses them
        spans = events.table(sort_by=f"{device}_time_total", row_limit=SPANS)
        text, trace = os.path.join(self.logs, "profile.txt"), os.path.join(self.logs, "profile_trace.json")
        with files.atomic_path(text) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"# {self.steps} training steps after the first {SKIP}, sorted by self_{device}_time_total\n"
                        f"{table}\n\n# the same steps, sorted by {device}_time_total (a range holds what ran in it)\n"
                        f"{spans}\n")
        with files.atomic_path(trace) as tmp:
            prof.export_chrome_trace(tmp)
        log.info(f"profile of steps {SKIP + 1}-{SKIP + self.steps}: {text} (operators by time), {trace} (timeline)")

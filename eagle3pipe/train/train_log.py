"""Stage 04's dense log: one plain line every N steps (step/total, loss, per-position accuracy, lr, tok/s, data
wait, TFLOP/s and MFU, ETA), the same in a terminal and under nohup, and every metric record as a JSON line
(`logs/metrics.jsonl`, which stage 05 plots)."""
import json
import logging
import os
import time

from ..storage import outdir
from .flops import draft_flops_per_token, muon_flops_per_step, peak_flops


log = logging.getLogger("eagle3")


class DenseLog(logging.Handler):
    """One line every N steps from speculators' metric records: step/total, loss, per-position accuracy, lr,
    tok/s, ETA. Plain text, so it reads the same in a terminal and in a nohup log. tok/s and the data wait are
    measured on this process's clock since the previous line (`clock`: the training loader's, input_watch.BatchGuard),
    not taken from speculators' step profile, whose logged step also holds the previous step's GPU work."""

    def __init__(self, every, total_steps=None, jsonl=None, tokens_per_step=None):
        super().__init__()
        self.every, self.total, self.t0, self.step0, self.tokens = every, total_steps, None, None, 0
        self.estimated = False
        self.fetch_ms = self.step_ms = 0.0  # the time the step waited for its batch, summed over the logged steps
        self.jsonl = jsonl  # every metric record, one JSON line each: stage 05 plots the training curves
        self.flops_per_token = self.peak = None  # set once the model exists (PipelineTrainer.setup_model)
        self.tokens_per_step = tokens_per_step  # a rank's packed batch (--total-seq-len): what Muon's fixed cost is shared by
        self.clock, self.last, self.wall, self.waited = None, None, 0.0, 0.0  # the loader's clock, when attached

    def emit(self, record):
        msg = record.msg
        if not isinstance(msg, dict) or not ("train" in msg or "val" in msg):
            return
        if self.jsonl:
            with os.fdopen(outdir.open_append(self.jsonl), "a", encoding="utf-8") as f:
                f.write(json.dumps(msg, default=float) + "\n")
        if "train" not in msg:
            return
        step = msg.get("global_step", 0) + 1
        if self.t0 is None:
            self.t0, self.step0 = time.time(), step - 1
            c = self.clock() if self.clock else None
            if c is not None:  # on a GPU most of it is compiling the draft's step (cached: compile_cache.py)
                log.info(f"first step {time.perf_counter() - c[0]:.1f} s after the epoch began ({c[1]:.1f} s of it "
                         f"waiting on data)")
        m, prof = msg["train"], msg.get("profile") or {}
        self.fetch_ms += prof.get("fetch_ms", 0.0)
        self.step_ms += prof.get("step_ms", 0.0)
        done = step - self.step0
        if done >= 4 and not self.estimated and self.total and self.total > step:  # timed after the first step
            self.estimated, rate = True, (time.time() - self.t0) / (done - 1)
            left = rate * (self.total - step)
            finish = time.strftime('%H:%M', time.localtime(time.time() + left))
            log.info(f"estimate from steps {self.step0 + 2}-{step} at {rate:.2f} s/step: the remaining "
                     f"{self.total - step} steps take about {max(1, round(left / 60))} min (done near {finish}), plus "
                     f"validation and checkpoints")
        if step % self.every and step != self.total:
            return
        acc = " ".join(f"{m[k]:.2f}" for k in sorted(k for k in m if "acc" in k and "full" in k)) or \
            " ".join(f"{m[k]:.2f}" for k in sorted(k for k in m if "acc" in k))
        rate = (time.time() - self.t0) / max(done - 1, 1)
        eta = f" ETA {int(rate * (self.total - step)) // 60}m{int(rate * (self.total - step)) % 60:02d}s" \
            if self.total else ""
        lr = msg.get("lr")
        lr = lr if isinstance(lr, (int, float)) else next(iter(lr.values()), 0) if isinstance(lr, dict) else 0
        total = f"/{self.total}" if self.total else ""
        tok_s, wait = self.measured(prof)
        log.info(f"step {step}{total} epoch {msg.get('epoch', 0)} loss {m.get('loss', float('nan')):.4f} "
                 f"acc[{acc}] lr {lr:.2e} {tok_s:,.0f} tok/s{self.utilization(tok_s)} data wait {wait:.0%}{eta}")

    def measured(self, prof):
        """(tokens a second, the share of the time spent waiting on the loader) since the previous line, or since the
        epoch's first batch was asked for; speculators' step profile where no loader clock is attached."""
        c = self.clock() if self.clock else None
        if c is None:
            return prof.get("tokens_per_s", 0), prof.get("fetch_frac", 0)
        started, waited, tokens = c
        if self.last is None or self.last[0] != started:  # a new epoch: validation and saves are not training time
            self.last = (started, started, 0.0, 0)
        _, t, w, n = self.last
        now = time.perf_counter()
        self.last, dt = (started, now, waited, tokens), now - t
        self.wall, self.waited = self.wall + dt, self.waited + waited - w
        return ((tokens - n) / dt, (waited - w) / dt) if dt > 0 else (0.0, 0.0)

    def utilization(self, tok_s):
        """` 41.2 TFLOP/s MFU 4.2%`: the model FLOPs the tokens cost per second, and their fraction of the device's
        dense peak where it is known: an operator sees whether the GPU or the data is the limit."""
        if not self.flops_per_token:
            return ""
        done = tok_s * self.flops_per_token
        return f" {done / 1e12:.2f} TFLOP/s" + (f" MFU {done / self.peak:.1%}" if self.peak else "")

    def count_flops(self, model, ttt_steps, device_name, dtype, optimizer=None, tokens_per_step=None, ns_steps=5):
        """Once the model exists: its FLOPs a token (flops.draft_flops_per_token) and the device's peak, said once;
        under Muon, what its Newton-Schulz iterations add to each step (flops.muon_flops_per_step), which MFU
        leaves out and a wide draft feels."""
        params = [(n, tuple(p.shape), p.requires_grad) for n, p in getattr(model, "module", model).named_parameters()]
        if any("flat_param" in n for n, _, _ in params):  # FSDP1's flattened parameters keep no shapes
            return
        self.flops_per_token, self.peak = draft_flops_per_token(params, ttt_steps), peak_flops(device_name, dtype)
        where = (f"of a {self.peak / 1e12:.0f} TFLOP/s peak ({device_name}, {dtype} dense)" if self.peak else
                 f"(no known peak for {device_name or 'a CPU'} in {dtype}: no MFU)")
        log.info(f"model FLOPs: {self.flops_per_token / 1e9:.3f} GFLOP a trained token ({ttt_steps} TTT steps, "
                 f"forward and backward; attention scores not counted); the dense log shows TFLOP/s and MFU {where}")
        muon = muon_flops_per_step(params, ns_steps) if optimizer == "muon" else 0
        if muon and tokens_per_step:
            share = muon / (muon + self.flops_per_token * tokens_per_step)
            log.info(f"optimizer: Muon's Newton-Schulz iterations add {muon / 1e12:.2f} TFLOP a step ({ns_steps} "
                     f"iterations), {muon / tokens_per_step / 1e9:.3f} GFLOP a token at {tokens_per_step:,} tokens a "
                     f"step: {share:.0%} of a step's FLOPs, outside MFU (model FLOPs only); more tokens a step "
                     f"(--total-seq-len) make it a smaller share")

    @property
    def wait_fraction(self):
        if self.wall:
            return round(self.waited / self.wall, 4)
        return round(self.fetch_ms / self.step_ms, 4) if self.step_ms else None

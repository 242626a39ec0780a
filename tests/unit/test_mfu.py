"""Stage 04's MFU line: the model FLOPs a trained token costs, counted from the draft's parameters, and the fraction
of the device's dense peak the run reaches, in the dense log (eagle3pipe/train/train_log.py DenseLog, compute.py)."""
import contextlib
import logging

from eagle3pipe.train import flops, train_log

H, I, DV = 64, 128, 256  # hidden, intermediate, draft vocabulary
DRAFT = [("embed_tokens.weight", (1000, H), False),  # a lookup, not a matmul
         ("fc.weight", (H, 3 * H), True),
         ("layers.0.self_attn.q_proj.weight", (H, 2 * H), True), ("layers.0.self_attn.o_proj.weight", (H, H), True),
         ("layers.0.mlp.down_proj.weight", (H, I), True), ("layers.0.input_layernorm.weight", (2 * H,), True),
         ("norm.weight", (H,), True), ("lm_head.weight", (DV, H), False),  # frozen, the gradient through it
         ("verifier_lm_head.weight", (DV, H), False)]  # the targets: forward only


def test_flops_count_the_fc_once_the_layer_and_head_per_ttt_step_and_the_targets_forward():
    fc, layer, head = H * 3 * H, H * 2 * H + H * H + H * I, DV * H
    # trained: 6 a weight; the frozen draft head: 4 (forward, and the gradient to its input); the targets: 2
    assert flops.draft_flops_per_token(DRAFT, 3) == 6 * fc + 3 * (6 * layer + 4 * head) + 2 * head
    assert flops.draft_flops_per_token(DRAFT, 5) - flops.draft_flops_per_token(DRAFT, 3) == 2 * (6 * layer + 4 * head)
    trained_head = [(n, s, True if n == "lm_head.weight" else t) for n, s, t in DRAFT]
    assert flops.draft_flops_per_token(trained_head, 3) - flops.draft_flops_per_token(DRAFT, 3) == 3 * 2 * head


def test_the_peak_is_known_for_data_center_gpus_in_bf16_only():
    assert flops.peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16") == 312e12  # A100, not A10
    assert flops.peak_flops("NVIDIA A10", "bfloat16") == 125e12
    assert flops.peak_flops("NVIDIA H200", "float32") is None and flops.peak_flops(None, "bfloat16") is None
    assert flops.peak_flops("Tesla T4", "bfloat16") is None


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def draft_module(init):
    """A torch module holding DRAFT's parameters by their names (init: torch.zeros or torch.randn)."""
    import torch
    model = torch.nn.Module()
    for name, shape, trainable in DRAFT:
        *path, leaf = name.split(".")
        owner = model
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(init(shape), requires_grad=trainable))
    return model


@contextlib.contextmanager
def logged():
    """The eagle3 logger's INFO lines while the block runs."""
    seen, logger = Lines(), logging.getLogger("eagle3")
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)


def test_the_dense_line_carries_tflops_and_mfu_where_the_peak_is_known():
    import torch
    model = draft_module(torch.zeros)
    with logged() as seen:
        dense = train_log.DenseLog(every=1, total_steps=2)
        dense.count_flops(model, 3, "NVIDIA H200", "bfloat16")
        per = flops.draft_flops_per_token(DRAFT, 3)
        assert dense.flops_per_token == per and f"{per / 1e9:.3f} GFLOP a trained token" in seen.lines[-1]
        assert "of a 989 TFLOP/s peak (NVIDIA H200, bfloat16 dense)" in seen.lines[-1]
        tokens_per_s = 1e6
        dense.emit(logging.makeLogRecord({"msg": {"train": {"loss": 1.0}, "global_step": 1, "epoch": 0,
                                                  "profile": {"tokens_per_s": tokens_per_s, "fetch_frac": 0.02}}}))
        done = tokens_per_s * per
        assert f"1,000,000 tok/s {done / 1e12:.2f} TFLOP/s MFU {done / 989e12:.1%} data wait 2%" in seen.lines[-1]
        cpu = train_log.DenseLog(every=1)
        cpu.count_flops(model, 3, None, "float32")
        assert "no known peak for a CPU in float32: no MFU" in seen.lines[-1] and cpu.peak is None
        assert cpu.utilization(1e6) == f" {done / 1e12:.2f} TFLOP/s"


def test_tok_s_and_data_wait_are_read_on_the_loaders_clock():
    """The dense line's tok/s and data wait come from the training loader's own clock (input_watch.BatchGuard), not
    from speculators' step profile (which says 0 % here): a loader that sleeps before every batch while the step
    takes no time reads as nearly all waiting; the same batches handed out at once to a step that sleeps, as
    almost none. Extreme contrasts, so the verdicts hold on any machine."""
    import time
    import torch
    from eagle3pipe.storage.input_watch import BatchGuard

    def batches(n, pause):
        for _ in range(n):
            time.sleep(pause)  # a slow loader: the fault this line must show
            yield {"document_ids": torch.tensor([0, 0, 1, -1])}  # 3 tokens and a pad

    with logged() as seen:
        for loader_pause, step_pause, waiting in ((0.05, 0.0, True), (0.0, 0.05, False)):
            dense, guard = train_log.DenseLog(every=1), BatchGuard(batches(4, loader_pause))
            dense.clock = guard.clock
            for step, _ in enumerate(guard):
                time.sleep(step_pause)  # the training step
                dense.emit(logging.makeLogRecord({"msg": {"train": {"loss": 1.0}, "global_step": step, "epoch": 0,
                                                          "profile": {"tokens_per_s": 1.0, "fetch_frac": 0.0}}}))
            wait = int(seen.lines[-1].split("data wait ")[1].split("%")[0])
            assert (wait > 50) == waiting, (loader_pause, step_pause, seen.lines[-1])
            assert (dense.wait_fraction > 0.5) == waiting and guard.tokens == 12, dense.wait_fraction
            assert " 1 tok/s" not in seen.lines[-1]  # not the profile's figure
            first = [line for line in seen.lines if line.startswith("first step ")]
            waited = float(first[-1].split("(")[1].split(" s of it")[0])
            assert len(first) == (1 if waiting else 2) and (waited >= 0.04) == waiting, first  # once a run


def test_muons_newton_schulz_flops_are_what_torchs_muon_computes_on_speculators_split():
    """flops.muon_flops_per_step against the matmul FLOPs torch's flop counter sees in one real step of the
    optimizers speculators builds for --optimizer muon (its own split: heads, embeddings and vectors go to AdamW),
    on the DRAFT's shapes; and the log line that puts it beside the model's FLOPs."""
    import types
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from speculators.train.optimizers import build_optimizers
    model = draft_module(torch.randn)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    cfg = types.SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.0, muon_lr=1e-3, muon_momentum=0.95,
                                muon_weight_decay=0.0, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")
    counter = FlopCounterMode(display=False)
    with counter:
        for opt in build_optimizers(model, cfg):
            opt.step()
    expected = flops.muon_flops_per_step(DRAFT, 5)
    assert expected > 0 and counter.get_total_flops() == expected, (counter.get_total_flops(), expected)
    assert flops.muon_flops_per_step(DRAFT, 3) * 5 == expected * 3
    with logged() as seen:
        train_log.DenseLog(every=1).count_flops(model, 3, "NVIDIA H200", "bfloat16", "muon", 1000, 5)
        share = expected / (expected + 1000 * flops.draft_flops_per_token(DRAFT, 3))
        assert f"{expected / 1e12:.2f} TFLOP a step (5 iterations)" in seen.lines[-1]
        assert f"{share:.0%} of a step's FLOPs, outside MFU" in seen.lines[-1]
        train_log.DenseLog(every=1).count_flops(model, 3, "NVIDIA H200", "bfloat16", "adamw", 1000, 5)
        assert "optimizer:" not in seen.lines[-1]


def test_muon_at_kimis_width_costs_about_as_much_as_the_model_at_8k_tokens_a_step():
    """The arithmetic behind docs/BENCHMARKS.md's explanation of the MFU at Kimi's width: the 7168-wide MLA draft's
    nine Muon matrices (the FC and one layer) against its 13.36 GFLOP a token."""
    h, i = 7168, 18432
    mats = [("fc.weight", (h, 3 * h)), ("q_a_proj.weight", (1536, 2 * h)), ("q_b_proj.weight", (64 * 192, 1536)),
            ("kv_a_proj_with_mqa.weight", (576, 2 * h)), ("kv_b_proj.weight", (64 * 256, 512)),
            ("o_proj.weight", (h, 64 * 128)), ("gate_proj.weight", (i, h)), ("up_proj.weight", (i, h)),
            ("down_proj.weight", (h, i))]
    muon = flops.muon_flops_per_step([(n, s, True) for n, s in mats], 5)
    assert 100e12 < muon < 115e12  # about 107 TFLOP a step
    assert 0.9 < muon / (13.36e9 * 8192) < 1.1

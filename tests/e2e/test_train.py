"""Stage 04 end to end on real extracted hidden states: a short CPU training run with a falling loss into
speculators' checkpoint layout (refusals: tests/cli/test_train.py; kills and resume:
tests/reliability/test_stage04_faults.py; vLLM serving it with greedy output unchanged: tests/slow/test_serve.py)."""
import json
import os
import pathlib
import re

from conftest import TRAINED_EPOCHS, losses


def test_training_lowers_the_loss_into_a_servable_checkpoint(trained, model_path):
    out, p = trained
    ls = losses(p.stderr)
    assert len(ls) >= 10, p.stderr[-2000:]
    first, last = sum(ls[:3]) / 3, sum(ls[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert re.search(r"step \d+/\d+ epoch \d+ loss [0-9.]+ acc\[[0-9. ]+\] lr [0-9.e+-]+ [0-9,]+ tok/s "
                     r"[0-9.]+ TFLOP/s data wait \d+% ETA", p.stderr)  # no MFU on a CPU: no known peak
    # the model FLOPs the log counts: 6 a weight for the FC once and the layer per TTT step (3), 4 for speculators'
    # frozen draft head per step (the gradient passes through it), 2 for the verifier's head over the draft
    # vocabulary (the targets, forward only)
    from safetensors import safe_open
    with safe_open(out / "last" / "model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    size = lambda keys: sum(shapes[k][0] * shapes[k][1] for k in keys if len(shapes[k]) == 2)  # noqa: E731
    fc, head = size(k for k in shapes if k.startswith("fc.")), size(["lm_head.weight"])
    layers = size(k for k in shapes if k.startswith("layers."))
    want = 6 * fc + 3 * (6 * layers + 4 * head) + 2 * head
    said = re.search(r"model FLOPs: ([0-9.]+) GFLOP a trained token \(3 TTT steps", p.stderr)
    assert said and abs(float(said.group(1)) - want / 1e9) < 1e-3, (said and said.group(1), want)
    assert "no known peak for a CPU" in p.stderr
    # --profile-steps 2 (conftest): steps 6-7 profiled, the operators by time and the timeline in logs/
    table = (out / "logs" / "profile.txt").read_text()
    assert table.startswith("# 2 training steps after the first 5") and "aten::mm" in table, table[:2000]
    trace = json.load(open(out / "logs" / "profile_trace.json"))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "profile of steps 6-7: " in p.stderr
    # the second table holds the ranges: the optimizers' steps among them (Muon's Newton-Schulz runs in its own)
    assert "Optimizer.step#Muon.step" in table.split("time_total (a range holds")[1], table[-3000:]
    # the default optimizer is Muon: its fixed cost a step is said beside the model's FLOPs, for 1024 tokens a step
    assert re.search(r"optimizer: Muon's Newton-Schulz iterations add [0-9.]+ TFLOP a step \(5 iterations\), "
                     r"[0-9.]+ GFLOP a token at 1,024 tokens a step", p.stderr), p.stderr[-3000:]
    last_dir = out / "last"
    assert last_dir.is_symlink() and (last_dir / "config.json").exists()
    cfg = json.load(open(last_dir / "config.json"))
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["draft_vocab_size"] == 2048
    from safetensors import safe_open
    with safe_open(last_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"d2t", "t2d"} <= keys and any(k.startswith("fc") for k in keys)
    man = json.load(open(out / "manifest.json"))
    assert man["stage"] == "train" and man["layer_ids"] == [2, 15, 27, 30] and man["steps"] > 0
    # the states were computed in float32 and stored bf16 (conftest); training computed in auto's dtype, said first
    from eagle3pipe.base import compute
    hs_man = json.load(open(pathlib.Path(man["inputs"]["hidden_states"]) / "manifest.json"))
    assert hs_man["compute_dtype"] == "float32" and hs_man["storage_dtype"] == "bf16"
    auto = compute.resolve("auto", on_gpu=False)
    assert man["compute_dtype"] == auto.dtype and man["speculators_config"]["hidden_states_dtype"] == auto.dtype
    assert auto.describe() in p.stderr
    assert re.search(r"estimate from steps 2-\d+ at [0-9.]+ s/step: the remaining \d+ steps take about \d+ min",
                     p.stderr), p.stderr[-3000:]
    from eagle3pipe.engines.engine import serve_command  # the command that works with the vLLM installed here
    assert f"serve it: {serve_command(model_path, str(out / 'last'), 3)}" in p.stdout, p.stdout[-600:]
    # checkpoint_best by the acceptance measure (conftest's `trained`: 4 prompts asked; the 2 validation rows give
    # their distinct first turns): every epoch's val_metrics.json carries it beside the trainer's estimate, and the
    # best is the epoch it scores highest
    scores, n = {}, None
    for e in sorted(d.name for d in out.iterdir() if d.name.isdigit()):
        vm = json.load(open(out / e / "val_metrics.json"))
        m = vm["acceptance_measure"]
        n = n or m["prompts"]
        assert (m["k"], m["max_new_tokens"], m["prompts"], len(m["per_position"])) == (3, 24, n, 3) and 1 <= n <= 2, m
        assert 1 <= m["acceptance_length"] <= 4 and vm["expected_acceptance_length"] > 1
        scores[e] = m["acceptance_length"]
    assert len(scores) == TRAINED_EPOCHS and scores[os.readlink(out / "checkpoint_best")] == max(scores.values()), scores
    assert man["best_acceptance_measure"] == max(scores.values())
    assert f"acceptance measure: the verifier's greedy continuations of {n} validation prompts" in p.stderr
    assert re.search(rf"checkpoint_best -> \d: acceptance length [0-9.]+ by the measure \({n} held-out prompts, 24 "
                     r"tokens, k=3\); the trainer's estimate [0-9.]+ on the validation rows", p.stderr), p.stderr[-3000:]


def test_the_acceptance_measure_runs_a_compiled_draft_eagerly(trained):
    """On a GPU speculators compiles the draft's forward; the measure calls it once a prompt, each prompt another
    length, under no_grad: compiled, every call recompiled until torch's limit. Here the forward is compiled as
    speculators compiles it on a GPU, through a backend that counts the graphs it is handed."""
    import torch
    from eagle3pipe.measures import acceptance
    model, _ = acceptance.load_draft(str(trained[0] / "last"))
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=counting)
    width = model.fc.weight.shape[1]  # the auxiliary states side by side
    for n in (9, 14):  # two prompts of different lengths
        pred = acceptance.draft_predictions(model, torch.randn(n, width), list(range(5, 5 + n)), 3)
        assert pred.shape == (3, n - 1)
    assert graphs == []
    with torch.no_grad():  # the same call outside the measure compiles: the counter sees it
        model(hidden_states=torch.randn(1, 8, width), input_ids=torch.arange(8)[None],
              document_ids=torch.zeros(1, 8, dtype=torch.long), position_ids=torch.arange(1, 9)[None], ttt_steps=3)
    assert graphs
    torch._dynamo.reset()


def test_the_acceptance_measure_reads_a_draft_with_the_whole_vocabulary(trained):
    """A draft whose vocabulary is the verifier's (stage 03 with --draft-vocab-size of the verifier's size) has no
    d2t in speculators: its ids are the verifier's. The measure reads its guesses as they are: the argmax of its own
    head at every step, in the verifier's vocabulary."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from eagle3pipe.measures import acceptance
    from eagle3pipe import adapters
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(trained[0] / "last"))
    adapters.use_sdpa(cfg.transformer_layer_config)  # as acceptance.load_draft builds it
    vocab = cfg.transformer_layer_config.vocab_size
    cfg.draft_vocab_size = vocab
    torch.manual_seed(0)
    model = Eagle3DraftModel(config=cfg).eval()
    for p in model.parameters():  # speculators fills the heads with NaN until weights load: any real numbers
        torch.nn.init.normal_(p, std=0.05)
    assert model.d2t is None and model.lm_head.weight.shape[0] == vocab
    width, n = model.fc.weight.shape[1], 11
    pred = acceptance.draft_predictions(model, torch.randn(n, width), list(range(5, 5 + n)), 3)
    assert pred.shape == (3, n - 1) and pred.dtype == torch.long
    assert int(pred.max()) < vocab and len(set(pred.flatten().tolist())) > 1  # guesses over the whole vocabulary

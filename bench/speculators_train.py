"""speculators' own `train` command, on GPU or on a CPU-only machine (used by bench/speculators_pipeline.sh, bench_train.py).

    .venv/bin/python -m bench.speculators_train <speculators train flags ...>      # from the repository root

Takes exactly the flags of `speculators train` and runs the same code: speculators' TrainConfig.resolve(argv) and
speculators.train.cli.main(cfg) (its draft construction, d2t/t2d from <data-path>/token_freq.pt, its Arrow +
hs_{i}.safetensors data loading, packing, TTT loss and checkpoints). Added on top, only when torch has no
accelerator: the CPU adaptations of eagle3pipe/adapters.py (cpu_without_accelerator) and the Trainer subclass
from eagle3pipe.train.training.make_trainer_class. The subclass also keeps a `last` symlink to the newest
checkpoint, and its DenseLog appends every metric record to <save-path>/logs/metrics.jsonl.
"""
import logging
import os
import sys
import warnings


def main(argv):
    import torch
    import contextlib
    from speculators.train.config import TrainConfig

    from eagle3pipe import adapters
    from eagle3pipe.train.train_log import DenseLog
    from eagle3pipe.train.training import make_trainer_class

    cfg = TrainConfig.resolve(argv)  # speculators' own flag parsing (exits 2 on a bad flag)
    flat = cfg.flatten()
    on_cpu = torch.accelerator.current_accelerator() is None
    if on_cpu:
        if flat["loss_implementation"] != "eager" or flat["draft_attn_impl"] not in ("sdpa", "eager"):
            sys.exit("on CPU pass --loss-implementation eager --draft-attn-impl sdpa "
                     "(the fused loss needs Triton on a GPU; flex attention is GPU-only)")
        warnings.filterwarnings("ignore", message=".*pin_memory.*no accelerator.*")

    logs = os.path.join(os.path.abspath(flat["save_path"]), "logs")
    os.makedirs(logs, exist_ok=True)
    dense = DenseLog(every=10, jsonl=os.path.join(logs, "metrics.jsonl"))
    base = make_trainer_class(dense, on_cpu, flat["max_steps"])

    class BenchTrainer(base):
        def setup_model(self):
            # after speculators' setup_metric_logger (a dictConfig that would drop earlier handlers);
            # observation only: speculators' own metric output is left as it is
            logging.getLogger("speculators.metrics").addHandler(dense)
            super().setup_model()

    with contextlib.ExitStack() as stack:  # the pipeline's adaptations, for this run only (eagle3pipe/adapters.py)
        if on_cpu:
            stack.enter_context(adapters.cpu_without_accelerator())
        stack.enter_context(adapters.speculators_entry(BenchTrainer)).main(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where each setting came from (an explicit flag, the `--config` file, or the default), and the contradictions
between them: a setting that the others make meaningless.

A flag the operator typed and the run then ignores is a silent contradiction (`--hidden-states X` beside a config's
`online: true` started an engine and never read X). So a setting that the resolved settings ignore is refused, in one
line naming both sides, when the operator gave it explicitly, or when a config gave it as this stage's alone (in the
stage's section, or a top-level key no other stage takes) and an explicit flag is what makes it meaningless
(`train: {hidden_states: X}` in a config, `--online` typed). A top-level key other stages take too is shared: an
explicit flag that voids it for this stage wins, as flags win over a config (the shipped configs' `hidden_states`,
stage 02's output, beside `04_train.py --online`; the Kimi config's `tp_size` and `gpu_memory_utilization`, stage
05's too, beside stage 02's `--backend hf`). Between two keys of one config it is accepted.
"""
import os

from ..base.errors import UsageError
from ..chat.conversations import SHAREGPT
from ..engines import engines

# stage -> [(setting, matters(record) -> bool, the settings that decide it, why it is ignored)]
IGNORED_UNLESS = {
    "prepare": [(name, lambda r: r.regenerate, ("regenerate",), "it sets up --regenerate")
                for name in ("regen_temperature", "regen_max_tokens", "regen_batch_size", "regen_tp_size",
                             "regen_engine", "regen_samples", "dtype")]
               + [("split", lambda r: _hub_dataset(r.dataset) or r.split == "train", ("dataset",),
                   "a split is a hub dataset's; a local file or folder, or the embedded ShareGPT, has none")],
    "extract": [
        ("tp_size", lambda r: engines.kind(r.backend).tensor_parallel or r.tp_size == 1, ("backend",),
         "the hf backend has no tensor parallelism (it runs on one device)"),
        ("gpu_memory_utilization", lambda r: engines.kind(r.backend).memory_fraction, ("backend",),
         "it is the vllm backend's setting"),
    ],
    "train": [
        ("measure_prompts", lambda r: not r.fsdp or not r.measure_prompts, ("fsdp",),
         "FSDP shards the draft over the ranks, and the measure runs a whole draft on one"),
        ("hidden_states", lambda r: not r.online, ("online",),
         "offline training reads stage 02's folder; --online generates the states instead"),
        ("backend", lambda r: r.online, ("online",), "it picks the engine --online starts"),
        ("engine_timeout", lambda r: r.online, ("online",), "it bounds the start of the engine --online starts"),
        # speculators builds no scheduler at all for `none` (Trainer.setup_optimizer), warmup included; no warmup is
        # what `none` does anyway
        ("warmup_steps", lambda r: r.scheduler != "none" or not r.warmup_steps, ("scheduler",),
         "with no scheduler the learning rate is --lr from step 1, with no warmup"),
        # step k's loss weighs decay**k (speculators' exp_loss_decay): a single step (k = 0) always weighs 1
        ("ttt_step_loss_decay", lambda r: r.ttt_steps > 1 or r.ttt_step_loss_decay == 1, ("ttt_steps",),
         "with one TTT step there is no later step to weigh less"),
        ("measure_tokens", lambda r: r.measure_prompts > 0, ("measure_prompts",),
         "with no prompts to measure on, the trainer's estimate chooses checkpoint_best"),
    ],
}


def _hub_dataset(dataset):
    return dataset != SHAREGPT and not os.path.exists(dataset)


def explicit(parser, argv):
    """{dest: the flag as typed} for every option given on the command line (abbreviations are off)."""
    by_flag = parser._option_string_actions  # argparse's own index of its options (public since 3.x, undocumented)
    given = {}
    for token in argv:
        if not token.startswith("--"):
            continue
        action = by_flag.get(token.split("=", 1)[0])
        if action is not None:
            given.setdefault(action.dest, token.split("=", 1)[0])
    return given


def _flag(name):
    return "--" + name.replace("_", "-")


def _config_words(name, value, config_path, origin=None):
    shown = str(value).lower() if isinstance(value, bool) else value
    return f"'{(origin or {}).get(name, name)}: {shown}' in --config {config_path}"


def refuse_contradictions(stage, record, flags, config, config_path, own=frozenset(), origin=None):
    """One line, exit 2, for the first setting the record ignores that the operator asked for (see the module's
    docstring). `flags`: {dest: flag typed}; `config`: the fields the config file set; `own`: those of them that
    are this stage's alone; `origin`: each field's key as the file spells it (cli.load_config)."""
    for name, matters, deciders, why in IGNORED_UNLESS.get(stage, []):
        if matters(record):
            continue
        value = getattr(record, name)
        decider = deciders[0]
        decided = getattr(record, decider)
        if decider in flags:
            decider_words = flags[decider] + ("" if isinstance(decided, bool) else f" {decided}")
        elif decider in config:
            decider_words = _config_words(decider, decided, config_path, origin)
        else:
            decider_words = f"{_flag(decider)} {decided} (the default)"
        if name in flags and decided is False and decider not in config and decider not in flags:
            raise UsageError(f"{flags[name]} {value}: only with {_flag(decider)} ({why}); drop it, or add "
                             f"{_flag(decider)}")
        if name in flags:
            raise UsageError(f"{flags[name]} {value} contradicts {decider_words}: {why}; drop one of them")
        if name in own and decider in flags:  # typing the key's own flag instead would contradict it the same way
            raise UsageError(f"{_config_words(name, value, config_path, origin)} contradicts {decider_words}: {why}; "
                             f"remove the key, or drop {flags[decider]}")

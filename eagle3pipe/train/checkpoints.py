"""Stage 04's checkpoints: speculators saves each into `.saving/<epoch>` and it replaces `<epoch>` only once complete
(publish); a rerun finds a save cut short, a complete one still staged, or an `interrupted` one, and resumes from
what is whole (resume_state); `checkpoint_best` follows the acceptance measure, or the trainer's estimate without
it (update_best); the output folder is taken once (prepare_output).
"""
import json
import logging
import os
import time

from ..adapters import interrupted
from ..base import faults
from ..base.errors import RunError, UsageError
from ..config.cli import describe
from ..drafts import archs
from ..drafts.mla_draft import write_served
from ..engines.engine import eagle3_blocker, serve_command
from ..measures.acceptance import expected_acceptance
from ..storage import files, outdir
from ..storage.files import write_json
from ..storage.input_watch import check_training
from ..storage.ledger import ledger_of
from ..verifier.verifier import LAYER_ID_CONVENTION
from ..verifier.vllm_support import eagle3_refusal

log = logging.getLogger("eagle3")


STAGING = ".saving"  # speculators writes each checkpoint here; it is renamed into place once complete


# what speculators' save writes into STAGING/<epoch> (Checkpointer: save_pretrained, the optimizer and scheduler
# states, training_state.json, the command, validation metrics; config.py: the draft's code beside its config)
SAVE_FILES = (r"config\.json|config\.py|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|"
              r"model\.safetensors\.index\.json|optimizer_state_dict\.pt|scheduler_state_dict\.pt|"
              r"training_state\.json|train_command\.txt|val_metrics\.json")


def best_score(val_metrics, measured):
    """What `checkpoint_best` is chosen by: the measure's acceptance length when the run measures (a checkpoint
    saved without it, by an earlier run, scores -1 and is replaced), else the trainer's estimate. -> (score, name)."""
    if measured:
        got = (val_metrics.get("acceptance_measure") or {}).get("acceptance_length")
        return (-1.0 if got is None else float(got)), "measure"
    got = expected_acceptance(val_metrics)
    return (-1.0 if got is None else got), "estimate"


def best_acceptance(root, skip=None, measured=False):
    """The score (best_score) `checkpoint_best` was chosen for (-1 when there is none yet, or when it is the
    checkpoint `skip`, whose figures are being replaced)."""
    best = os.path.join(str(root), "checkpoint_best")
    if skip is not None and os.path.islink(best) and os.readlink(best) == skip:
        return -1.0
    try:
        with open(os.path.join(best, "val_metrics.json"), encoding="utf-8") as f:
            vm = json.load(f)
    except (OSError, ValueError):
        return -1.0
    return best_score(vm, measured)[0] if isinstance(vm, dict) else -1.0


def discard_staged(staged):
    """Free STAGING/<epoch> for a new save. What the record proves ours goes, and so do the files a save cut short
    left there under the names speculators saves (SAVE_FILES): the folder was made by this stage for that save alone
    (outdir.clear_scratch's rule). Anything else in it is kept: the folder is moved aside to
    STAGING/.cut-short-<epoch>-<time> and the log says so."""
    if not os.path.lexists(staged):
        return
    if not outdir.owned(staged):
        raise RunError(f"{outdir.quote(staged)}: not this stage's folder; move it away and rerun")
    outdir.clear_scratch(staged, SAVE_FILES)
    if not outdir.remove(staged):
        return
    aside = os.path.join(os.path.dirname(staged), f".cut-short-{os.path.basename(staged)}-{time.strftime('%Y%m%d-%H%M%S')}")
    outdir.move_aside(staged, aside)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(aside) for f in fs
               if not os.path.islink(os.path.join(d, f)))
    log.warning(f"a save cut short (a kill mid-save) left {len(os.listdir(aside))} entries, {size / 1e6:.0f} MB, that "
                f"no record proves this stage's: kept, moved to {outdir.quote(aside)}; delete it once checked")


def publish(root, epoch, local_step=0):
    """A complete save in STAGING/<epoch> becomes <epoch>: recorded, the previous <epoch> replaced (only if all of it
    is this stage's), then the `epoch{e}_{end|step}` and `last` links."""
    staged = os.path.join(root, STAGING, epoch)
    # speculators' own readability links (epoch{e}_end, made beside the staged save) point inside STAGING: ours
    # replace them
    outdir.clear_scratch(os.path.join(root, STAGING), r"epoch\d+_(end|step\d+)")
    outdir.record_tree(staged)
    outdir.replace_dir(staged, os.path.join(root, epoch))
    links = {"last": epoch}
    if epoch != "interrupted":
        links[f"epoch{epoch}_{f'step{local_step}' if local_step > 0 else 'end'}"] = epoch
        for name in os.listdir(root):  # the earlier link of this epoch
            if name.startswith(f"epoch{epoch}_") and name not in links and outdir.owned(os.path.join(root, name)):
                outdir.remove(os.path.join(root, name))
    for name, target in links.items():
        outdir.symlink(target, os.path.join(root, name))  # a stable pointer that is never missing


def resume_state(out):
    """Before speculators looks: a save killed mid-way is discarded (the previous checkpoint is whole), a complete one
    still in STAGING is published, and `interrupted/` (a Ctrl-C or SIGTERM) becomes the epoch it stopped in, so the
    rerun continues from the step it reached. -> a line saying which, or None."""
    staging = os.path.join(out, STAGING)
    said = None
    if outdir.owned(staging):
        for name in sorted(os.listdir(staging)):
            path = os.path.join(staging, name)
            if outdir.owned(path) and os.path.exists(os.path.join(path, "config.json")) and \
                    not outdir.remove(path, dry_run=True):  # complete: every file in it recorded
                publish(out, name)
            else:
                discard_staged(path)
    interrupted = os.path.join(out, "interrupted")
    state = os.path.join(interrupted, "training_state.json")
    if outdir.owned(state):
        with open(state) as f:
            st = json.load(f)
        epoch = str(st["epoch"])
        if _same_step(os.path.join(out, epoch), st):  # stopped at that epoch's end, after its own save: that one
            outdir.remove(interrupted)                 # stays, with its val_metrics.json (checkpoint_best reads it)
        else:
            outdir.replace_dir(interrupted, os.path.join(out, epoch))
        outdir.remove(os.path.join(out, "last"))
        outdir.symlink(epoch, os.path.join(out, "last"))
        said = f"resuming from the interrupted checkpoint: epoch {st['epoch']}, step {st['global_step']}"
    for name in sorted(os.listdir(out)):  # speculators resumes from these: every file in them must be the one we wrote
        path = os.path.join(out, name)
        if (name.isdigit() or name == "interrupted") and outdir.owned(path):
            left = outdir.remove(path, dry_run=True)
            if left:
                raise UsageError(f"--output-dir {out}: {outdir.quote(os.path.relpath(left[0], out))} is not what this "
                                 f"stage wrote (a link, or a file put there), and speculators would resume from the "
                                 f"folder that holds it: move it away and rerun")
            led, rel = ledger_of(path)
            gone = sorted(r for r, ident in led.entries.items() if r.startswith(rel + "/") and ident and
                          ident[0] != "t" and not os.path.lexists(os.path.join(led.root, r)))
            if gone:  # speculators would fail on it after the model and data loaded
                raise UsageError(f"--output-dir {out}: {outdir.quote(os.path.relpath(os.path.join(led.root, gone[0]), out))}"
                                 f" is gone (deleted since this stage wrote it), and speculators would resume from "
                                 f"{outdir.quote(name)}: move {outdir.quote(name)} away (training resumes from the "
                                 f"checkpoint before it, or starts over) and rerun")
    return said


def _same_step(folder, st):
    """Whether the checkpoint in `folder` is this stage's, whole, and at the step `st` (an `interrupted` state)."""
    path = os.path.join(folder, "training_state.json")
    if not (outdir.owned(path) and os.path.exists(os.path.join(folder, "config.json"))
            and not outdir.remove(folder, dry_run=True)):
        return False
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return False
    return st.get("local_step") == 0 and got.get("local_step") == 0 and got.get("global_step") == st.get("global_step")


def validate_pending(trainer):
    """Before the stage trainer's first epoch: the epoch a rerun resumes after is validated now when its validation
    never ran (a stop or a kill during its save, its validation or its acceptance measure left the checkpoint whole
    and no val_metrics.json), so that it can still be checkpoint_best. Every rank looks before rank 0 writes."""
    epoch = trainer.current_epoch - 1
    if epoch < 0 or trainer.val_loader is None or trainer._resume_local_step:  # mid-epoch: the one before was validated
        return
    folder = trainer.checkpointer.path / str(epoch)
    if not (folder / "config.json").exists() or (folder / "val_metrics.json").exists():
        return
    if trainer.is_distributed:
        import torch.distributed as dist
        dist.barrier()
    log.info(f"epoch {epoch}: validating it first (the run that trained it stopped before its validation)")
    trainer.maybe_update_best(epoch, trainer.val_epoch(epoch))


def prepare_output(args, identity, inputs, rank, carry=lambda old: {}):
    """Rank 0 takes the folder (outdir.claim: only stage 04's own, the lock, --overwrite of exactly what earlier runs
    recorded) and resumes only with the same inputs. -> (the real output path, the manifest a finished earlier run
    left, or None)."""
    if rank != 0:
        return os.path.realpath(args.output_dir), None
    out, previous = files.take_output("--output-dir", args.output_dir, "train", identity, inputs,
                                      "checkpoints", overwrite=args.overwrite, carry=carry)
    said = resume_state(out)
    if said:
        log.info(said)
    return out, previous


def save(trainer, epoch, local_step, save_):
    """The stage trainer's maybe_save_checkpoint: speculators' save (`save_`) goes into STAGING/<epoch>; once
    complete it replaces <epoch> (a kill mid-save leaves the previous checkpoint whole), and the links are made
    here."""
    root = trainer.checkpointer.path
    staged = root / STAGING / str(epoch)
    if epoch != "interrupted":  # the inputs this run started from, still the same (input_watch)
        check_training()
    if trainer.rank == 0:
        outdir.make_dir(str(root / STAGING))
        discard_staged(str(staged))
        if epoch == "interrupted" and trainer.global_step == 0:
            return  # nothing trained: nothing to resume from
        outdir.make_dir(str(staged))  # made here, a real folder: speculators writes into nothing else
    trainer.checkpointer.path = root / STAGING
    try:
        save_(epoch, local_step)
    finally:
        trainer.checkpointer.path = root
    if trainer.rank == 0:  # speculators' readability link, made in STAGING: a kill must not leave it for --overwrite
        outdir.clear_scratch(str(root / STAGING), r"epoch\d+_(end|step\d+)")
    saved = (staged / "config.json").exists()
    if trainer.rank == 0 and saved:
        if epoch == "interrupted":  # speculators records no step for it: ours, so a rerun resumes from it
            per_epoch = max(1, len(trainer.train_loader))
            e, k = divmod(trainer.global_step, per_epoch)
            e, k = (e - 1, 0) if k == 0 else (e, k)
            files.write_json(str(staged / "training_state.json"),
                             {"epoch": e, "local_step": k, "global_step": trainer.global_step})
        outdir.record_tree(str(staged))  # complete: a kill from here on leaves a save the rerun publishes
        write_served(str(staged))  # an MLA draft: vllm/, the config vLLM 0.32 reads, beside the same weights
    if saved:
        faults.kill_point("save")  # a reliability test: die with the save on disk but not in place
    if trainer.rank == 0 and not saved:
        discard_staged(str(staged))  # speculators chose not to save here: the empty folder goes
    elif trainer.rank == 0:
        publish(str(root), str(epoch), local_step)



def update_best(trainer, epoch, val_metrics, measure, by_loss):
    """The stage trainer's maybe_update_best: `checkpoint_best` -> the epoch whose draft has the highest acceptance length by the measure
    (validation_measure.py: what vLLM would count on the validation rows' first turns), or without it by the
    expected acceptance length on the validation rows (expected_acceptance); never the lowest loss: the two
    part ways late in training. Only an epoch that saved a checkpoint can be best (speculators' rule); the
    link and val_metrics.json are the stage's own files, written through outdir. `measure`:
    validation_measure.Measure or None; `by_loss`: speculators' own rule."""
    estimate = expected_acceptance(val_metrics)
    saved = (trainer.checkpointer.path / str(epoch) / "config.json").exists()  # this epoch has a checkpoint
    if estimate is None and measure is None:  # no per-position accuracies: speculators' own rule, by loss
        by_loss(epoch, val_metrics)
    elif trainer.rank == 0 and saved:  # every checkpoint carries its figures (stage 05 ranks by them too)
        record = {**val_metrics, "expected_acceptance_length": estimate}
        if measure is not None and not measure.failed:
            try:
                faults.signal_point("measure")  # a reliability test: a stop signal during the measure
                record["acceptance_measure"] = measure.score(trainer.model)
            except Exception as e:  # noqa: BLE001 - choosing the best epoch must never cost the training run
                if interrupted(e):  # a stop signal during the measure: the run stops, the measure did not fail
                    raise
                measure.failed = describe(e, advice=False)[1]
                log.warning(f"acceptance measure failed ({measure.failed}); checkpoint_best follows the trainer's "
                            f"estimate from here on")
        measured = measure is not None and not measure.failed
        write_json(str(trainer.checkpointer.path / str(epoch) / "val_metrics.json"), record)
        score = best_score(record, measured=measured)[0]
        said = (f"acceptance length {score:.3f} by the measure ({measure.describe()}); the trainer's "
                f"estimate {estimate or float('nan'):.3f} on the validation rows" if measured else
                f"expected acceptance length {score:.3f} on the validation rows")
        if score <= best_acceptance(trainer.checkpointer.path, skip=str(epoch), measured=measured):
            outdir.record(str(trainer.checkpointer.path / str(epoch) / "val_metrics.json"))
            log.info(f"epoch {epoch}: {said}; checkpoint_best stays")
            return
        outdir.symlink(str(epoch), str(trainer.checkpointer.path / "checkpoint_best"))
        trainer.best_val_loss = min(trainer.best_val_loss, val_metrics.get("loss_epoch", float("inf")))
        log.info(f"checkpoint_best -> {epoch}: {said} (loss {val_metrics.get('loss_epoch', float('nan')):.4f})")
    if trainer.rank == 0:
        for name in ("checkpoint_best", f"{epoch}/val_metrics.json"):
            if os.path.lexists(trainer.checkpointer.path / name):
                outdir.record(str(trainer.checkpointer.path / name))


def print_serve_command(args, out, text_cfg, on_cpu, arch, architecture=None):
    """The checkpoint, and the command that serves it with the vLLM installed here (or why it cannot here).
    `arch`: the draft's layer (archs.DraftArch); `architecture`: the verifier's (config.json), which the
    installed vLLM may have no EAGLE-3 support for."""
    last = os.path.join(out, "last")
    log.info(f"checkpoint: {last} -> {os.path.realpath(last)}")
    unserved = eagle3_refusal(architecture)
    if unserved:  # no command this vLLM runs: none printed
        log.warning(f"{unserved}; serve it with a vLLM that has EAGLE-3 support for {architecture}")
        return
    blocker = eagle3_blocker(text_cfg, not on_cpu, mla_draft=arch.attention == "mla")
    where = f" (on a GPU machine: {blocker})" if blocker else ""
    elsewhere = bool(blocker) or not on_cpu  # a GPU machine serves with vLLM's GPU build, installed here or not
    print(f"serve it{where}: {serve_command(args.model_path, last, args.ttt_steps, elsewhere, text_cfg)}")


def finish(s, plan, out, previous, result, cfg, on_cpu, dtype, rank):
    """After training: a run stopped by a signal says how to resume (exit 128+15); else rank 0 re-checks the
    inputs, writes the manifest (or keeps the earlier run's when nothing was left to train) and prints the
    checkpoint and the command that serves it. -> the exit status."""
    if os.path.basename(result["checkpoint_last"] or "") == "interrupted":  # SIGTERM/Ctrl-C: speculators saved it
        log.warning(f"stopped by a signal at step {result['steps']}; checkpoint {out}/interrupted; rerun the same "
                    f"command to resume")
        return 128 + 15
    if rank != 0:
        return 0
    plan.watch.check()
    if result["steps_this_run"] == 0 and previous:  # the checkpoint is what the earlier run trained
        files.write_json(os.path.join(out, files.MANIFEST), previous)
        log.info(f"nothing left to train: {out} is unchanged (its manifest says how it was trained)")
        return 0
    files.write_json(os.path.join(out, files.MANIFEST), files.manifest(
        "train", s, identity=plan.identity, verifier=plan.verifier, layer_ids=list(plan.ext.layer_ids),
        aux_layer_ids=plan.aux, layer_id_convention=LAYER_ID_CONVENTION, draft_vocab_size=plan.draft_vocab,
        compute_dtype=dtype.dtype, compute_dtype_reason=dtype.reason, recipe=plan.recipe,
        inputs={"prepared_data": os.path.abspath(s.prepared_data), "hidden_states": "online" if s.online else
                os.path.abspath(s.hidden_states), "vocab_mapping": os.path.abspath(s.vocab_mapping)},
        speculators_config=json.loads(json.dumps(cfg.flatten(), default=str)), **result))
    arch = archs.of(plan.recipe)
    print_serve_command(s, out, plan.text_cfg, on_cpu, arch, plan.verifier.get("architecture"))
    return 0

"""The adapter room (eagle3pipe/adapters.py): every private name it relies on is in the installed versions, a
version that lacks one is one line in under a second, each replacement is undone when its block ends, and no
other module of the package replaces another library's attribute."""
import ast
import os

import pytest

from conftest import REPO
from eagle3pipe import adapters
from eagle3pipe.base.errors import UsageError



@pytest.mark.parametrize("library", ["speculators", "vllm"])
def test_the_installed_versions_have_every_private_name_adapted(library):
    adapters.check_private(library)


def test_a_version_without_one_is_one_line_naming_it_and_the_pin(monkeypatch):
    gone = ("speculators/train/dataloader.py", r"\ndef _worker_init_fn_renamed\(", "dataloader._worker_init_fn")
    monkeypatch.setitem(adapters.PRIVATE, "speculators", adapters.PRIVATE["speculators"] + [gone])
    with pytest.raises(UsageError) as e:
        adapters.check_private("speculators")
    msg = str(e.value)
    assert "\n" not in msg and "dataloader._worker_init_fn" in msg and "speculators==0.9.0" in msg


def test_every_replacement_is_undone_when_its_block_ends():
    import torch
    import speculators.train.checkpointer as ckpt
    import speculators.train.cli as scli
    import speculators.train.dataloader as sdl
    from speculators.train.config import TrainConfig
    before = (torch.accelerator.synchronize, ckpt.get_current_device, scli.Trainer, scli.setup_metric_logger,
              sdl.ArrowDataset, sdl._worker_init_fn, TrainConfig.save)

    class Sub(scli.Trainer):
        pass
    with pytest.raises(RuntimeError, match="inside"):  # undone on an exception too
        with adapters.cpu_without_accelerator(), adapters.speculators_entry(Sub, own_metric_lines=False), \
                adapters.loader_dataset(object, print), adapters.recorded_artifacts(TrainConfig):
            assert scli.Trainer is Sub and sdl.ArrowDataset is object and sdl._worker_init_fn is print
            assert adapters.original(sdl, "_worker_init_fn") is before[5]  # what a forked worker calls
            if torch.accelerator.current_accelerator() is None:
                assert ckpt.get_current_device() == "cpu"
            raise RuntimeError("inside")
    after = (torch.accelerator.synchronize, ckpt.get_current_device, scli.Trainer, scli.setup_metric_logger,
             sdl.ArrowDataset, sdl._worker_init_fn, TrainConfig.save)
    assert after == before and adapters._originals == {}


# documented settings of another library's object, meant to be written by its users
PUBLIC_SETTINGS = {"daemon_threads",  # socketserver.ThreadingMixIn's, documented to be set per server
                   "name_or_path",    # speculators' VerifierConfig field (a pydantic model's public field)
                   "stdout", "stderr"}  # sys's, documented to be replaced (inherited.guard)


def _replacements(text, name):
    """Assignments to, or setattr on, an attribute of a module imported from another library."""
    tree = ast.parse(text)
    foreign = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("eagle3pipe")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("eagle3pipe"):
            foreign |= {a.asname or a.name for a in node.names}
    # names bound to what a call into another library returned (`model = AutoModel.from_pretrained(...)`): writing
    # one of their attributes changes that library's object just the same
    made = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            base = node.value.func
            while isinstance(base, (ast.Attribute, ast.Call)):
                base = base.value if isinstance(base, ast.Attribute) else base.func
            if isinstance(base, ast.Name) and base.id in foreign:
                for t in node.targets:
                    made |= {n.id for n in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(n, ast.Name)}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            base = t
            while isinstance(base, ast.Attribute):
                base = base.value
            if t is not base and isinstance(base, ast.Name) and (base.id in foreign or base.id in made) \
                    and not (isinstance(t, ast.Attribute) and t.attr in PUBLIC_SETTINGS):
                found.append(f"{name}:{node.lineno} {ast.unparse(t)}")
    return found


def test_no_module_but_the_adapter_room_replaces_another_library_s_attribute():
    pkg = os.path.join(REPO, "eagle3pipe")
    found = []
    for folder, _, names in sorted(os.walk(pkg)):
        for name in sorted(names):
            if name.endswith(".py") and name != "adapters.py":
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    found += _replacements(f.read(), name)
    assert found == []
    # the scan sees a replacement, however it is spelled
    probe = "import torch\nimport speculators.train.cli as scli\nfrom x import y\ntorch.a.b = 1\nscli.T = 2\n" \
            "setattr(y, 'z', 3)\nlocal = object()\nlocal.attr = 4\nm = y.load('p').to('cpu')\nm.flag = 5\n"
    assert sorted(r.split(" ", 1)[1] for r in _replacements(probe, "probe")) == ["m.flag", "scli.T", "torch.a.b", "y.?"]


def test_every_recipe_option_reaches_speculators_config_by_name():
    """speculators' TrainConfig.from_flat drops keys it does not know, silently: each recipe option must be one of
    its names, and the losses stage 04 accepts must be the ones it has."""
    from speculators.losses.utils import _EAGER_LOSS_FN_MAP, _FUSED_LOSS_FN_MAP
    from speculators.train.config import schema
    from eagle3pipe.config import settings
    from eagle3pipe.train import training
    assert set(training.DEFAULT_RECIPE) <= set(schema.CONFIG_DESTS)
    assert sorted(settings.Train.LOSSES) == sorted(_EAGER_LOSS_FN_MAP) == sorted(_FUSED_LOSS_FN_MAP)
    changed = {"draft_arch": "qwen3", "norm_before_fc": False, "fc_norm": True, "norm_output": False,
               "loss_fn": '{"ce": 0.1, "tv": 0.9}', "ttt_step_loss_decay": 0.8, "optimizer": "adamw",
               "scheduler_type": "cosine"}
    flat = schema.TrainConfig.from_flat({**training.DEFAULT_RECIPE, **changed}).flatten()
    assert {k: flat[k] for k in changed} == changed


def test_a_recipe_option_the_installed_vllm_cannot_serve_is_one_line(monkeypatch):
    adapters.check_serves({"draft_arch": "qwen3", "norm_before_fc": True, "fc_norm": True, "norm_output": True})
    monkeypatch.setitem(adapters.SERVES, "fc_norm", (adapters._EAGLE3, r"\bfc_norm_renamed\b"))
    with pytest.raises(UsageError) as e:
        adapters.check_serves({"draft_arch": "llama", "fc_norm": True})
    assert "\n" not in str(e.value) and str(e.value).startswith("--fc-norm: vllm") and "0.32" in str(e.value)


def test_every_trainer_method_we_override_and_attribute_we_touch_is_checked():
    """The stage's Trainer subclasses (training.py, their bodies in checkpoints.py) override speculators' methods and read or write its instance's
    attributes (`self.best_val_loss = ...`, `self.checkpointer.path = ...`): each such name must be in
    adapters.TRAINER_OVERRIDES / TRAINER_ATTRS, which PRIVATE checks against the installed speculators, so a
    rename upstream is one line before torch loads, not a silently skipped override."""
    from speculators.train.trainer import Trainer
    tree = ast.parse(open(os.path.join(REPO, "eagle3pipe", "train", "training.py")).read())
    overrides, touched = set(), set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        if not any(getattr(b, "id", "") in ("Trainer", "trainer_cls") for b in cls.bases):
            continue
        overrides |= {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and hasattr(Trainer, f.name)}
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and not hasattr(Trainer, node.attr):  # an instance attribute, read or written
                touched.add(node.attr)
    # and what the overrides' bodies in checkpoints.py do with the trainer they are handed
    for node in ast.walk(ast.parse(open(os.path.join(REPO, "eagle3pipe", "train", "checkpoints.py")).read())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer" \
                and not hasattr(Trainer, node.attr):
            touched.add(node.attr)
    assert overrides and overrides <= set(adapters.TRAINER_OVERRIDES), overrides - set(adapters.TRAINER_OVERRIDES)
    assert touched <= set(adapters.TRAINER_ATTRS), touched - set(adapters.TRAINER_ATTRS)
    assert "maybe_update_best" in overrides and {"best_val_loss", "checkpointer"} <= touched

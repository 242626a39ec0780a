"""The adapter room (eagle3pipe/adapters.py): every private name it relies on is in the installed versions, a
version that lacks one is one line in under a second, each replacement is undone when its block ends, and no
other module of the package replaces another library's attribute."""
import ast
import os

import pytest

from conftest import REPO
from eagle3pipe import adapters
from eagle3pipe.errors import UsageError



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
                adapters.online_dataset(object, print), adapters.recorded_artifacts(TrainConfig):
            assert scli.Trainer is Sub and sdl.ArrowDataset is object and sdl._worker_init_fn is print
            assert adapters.original(sdl, "_worker_init_fn") is before[5]  # what a forked worker calls
            if torch.accelerator.current_accelerator() is None:
                assert ckpt.get_current_device() == "cpu"
            raise RuntimeError("inside")
    after = (torch.accelerator.synchronize, ckpt.get_current_device, scli.Trainer, scli.setup_metric_logger,
             sdl.ArrowDataset, sdl._worker_init_fn, TrainConfig.save)
    assert after == before and adapters._originals == {}


def _replacements(text, name):
    """Assignments to, or setattr on, an attribute of a module imported from another library."""
    tree = ast.parse(text)
    foreign = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("eagle3pipe")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith("eagle3pipe"):
            foreign |= {a.asname or a.name for a in node.names}
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
            if t is not base and isinstance(base, ast.Name) and base.id in foreign:
                found.append(f"{name}:{node.lineno} {ast.unparse(t)}")
    return found


def test_no_module_but_the_adapter_room_replaces_another_library_s_attribute():
    pkg = os.path.join(REPO, "eagle3pipe")
    found = []
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py") and name != "adapters.py":
            with open(os.path.join(pkg, name), encoding="utf-8") as f:
                found += _replacements(f.read(), name)
    assert found == []
    # the scan sees a replacement, however it is spelled
    probe = "import torch\nimport speculators.train.cli as scli\nfrom x import y\ntorch.a.b = 1\nscli.T = 2\n" \
            "setattr(y, 'z', 3)\nlocal = object()\nlocal.attr = 4\n"
    assert [r.split(" ", 1)[1] for r in _replacements(probe, "probe")] == ["torch.a.b", "scli.T", "y.?"]

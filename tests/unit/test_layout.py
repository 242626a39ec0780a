"""docs/LAYOUT.md lists every module of the package, once."""
import os
import re

from conftest import REPO


def test_every_module_is_in_the_layout_list_once():
    pkg = sorted(n for n in os.listdir(os.path.join(REPO, "eagle3pipe")) if n.endswith(".py"))
    with open(os.path.join(REPO, "docs", "LAYOUT.md"), encoding="utf-8") as f:
        listed = re.findall(r"^  (\w+\.py) ", f.read(), flags=re.M)
    assert sorted(listed) == pkg

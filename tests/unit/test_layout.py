"""docs/LAYOUT.md lists every module of the package, once; no import circles between them."""
import os
import re

from conftest import REPO


def test_every_module_is_in_the_layout_list_once():
    pkg = sorted(n for n in os.listdir(os.path.join(REPO, "eagle3pipe")) if n.endswith(".py"))
    with open(os.path.join(REPO, "docs", "LAYOUT.md"), encoding="utf-8") as f:
        listed = re.findall(r"^  (\w+\.py) ", f.read(), flags=re.M)
    assert sorted(listed) == pkg


def test_no_import_circles_in_the_package():
    """No module of eagle3pipe imports, even inside a function, a module that imports it back, directly or around
    a circle: each room's dependencies point one way."""
    import ast
    pkg = os.path.join(REPO, "eagle3pipe")
    mods = {f[:-3] for f in os.listdir(pkg) if f.endswith(".py")}
    graph = {}
    for m in mods:
        deps = set()
        for n in ast.walk(ast.parse(open(os.path.join(pkg, m + ".py")).read())):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                deps |= {n.module.split(".")[0]} if n.module else {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("eagle3pipe"):
                parts = n.module.split(".")
                deps |= {parts[1]} if len(parts) > 1 else {a.name for a in n.names}
        graph[m] = (deps & mods) - {m}

    def reaches(a, b, seen):
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in graph[a])
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a, {b})})
    assert not circles, circles


def _wings():
    """docs/LAYOUT.md's wings table -> [(wing, kind, [modules])], bottom first."""
    with open(os.path.join(REPO, "docs", "LAYOUT.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| (\w+) \| (shared|stage) \| ([\w, ]+) \|$", f.read(), flags=re.M)
    return [(w, kind, [m.strip() for m in mods.split(",")]) for w, kind, mods in rows]


def test_every_import_follows_the_wings_rule():
    """A module imports only its own wing's modules or a shared wing's below it; no stage wing imports another
    (docs/LAYOUT.md). Inner imports count: an arrow hidden in a function is an arrow."""
    import ast
    pkg = os.path.join(REPO, "eagle3pipe")
    mods = sorted(f[:-3] for f in os.listdir(pkg) if f.endswith(".py") and f != "__init__.py")
    wings = _wings()
    where = {}
    for rank, (wing, kind, members) in enumerate(wings):
        for m in members:
            assert m not in where, f"{m} is in two wings"
            where[m] = (rank if kind == "shared" else len(wings), wing)
    assert sorted(where) == mods, ("in no wing", sorted(set(mods) - set(where)), "not a module",
                                   sorted(set(where) - set(mods)))
    against = []
    for m in mods:
        for n in ast.walk(ast.parse(open(os.path.join(pkg, m + ".py")).read())):
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                names = [n.module.split(".")[0]] if n.module else [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("eagle3pipe."):
                names = [n.module.split(".")[1]]
            else:
                continue
            for d in names:
                if d not in where or d == m:
                    continue
                (a, wa), (b, wb) = where[m], where[d]
                stage = a == len(wings)
                if (not stage and b > a) or (stage and b == a and wa != wb):
                    against.append(f"{m} ({wa}) -> {d} ({wb})")
    assert not against, against

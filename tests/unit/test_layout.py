"""docs/LAYOUT.md is the map of the package's folders: the tree holds to it, no folder is crowded, no import circle
and no import against the wings rule."""
import ast
import os
import re

from conftest import REPO

PKG = os.path.join(REPO, "eagle3pipe")
MAX_MODULES = 16  # a folder's modules, its __init__.py aside


def _layout():
    with open(os.path.join(REPO, "docs", "LAYOUT.md"), encoding="utf-8") as f:
        return f.read()


def _tree():
    """{folder ("" for the package's top level): sorted module file names} of the package as it is."""
    out = {}
    for folder, dirs, names in os.walk(PKG):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, PKG)
        out["" if rel == "." else rel] = sorted(n for n in names if n.endswith(".py"))
    return out


def _modules():
    """{dotted name: path} of every module of the package (its __init__.py files as their package's name)."""
    out = {}
    for folder, names in _tree().items():
        parts = ["eagle3pipe"] + ([folder] if folder else [])
        for n in names:
            out[".".join(parts + ([] if n == "__init__.py" else [n[:-3]]))] = os.path.join(PKG, folder, n)
    return out


def test_the_layout_page_is_the_map_of_the_folders():
    """Under the `eagle3pipe/` line of the page's tree: folders at two spaces (`base/`), their modules at four, the
    top level's modules at two. Every one there is listed, in its folder, once; every one listed is there."""
    text = _layout()
    listing = text[text.index("\neagle3pipe/ ") + 1:]
    listed, folder = {"": []}, ""
    for line in listing.splitlines()[1:]:
        if not line.startswith("  "):
            break
        m = re.match(r"^  (\w+)/\s", line)
        if m:
            folder = m.group(1)
            listed[folder] = []
            continue
        m = re.match(r"^(  |    )(\w+\.py)\s", line)
        if m:
            listed["" if m.group(1) == "  " else folder].append(m.group(2))
    # a folder's __init__.py is its docstring, the folder's line the page's
    assert {f: sorted(ns) for f, ns in listed.items()} == \
        {f: [n for n in ns if f == "" or n != "__init__.py"] for f, ns in _tree().items()}
    assert all(len(ns) == len(set(ns)) for ns in listed.values())


def test_no_folder_holds_more_than_sixteen_modules():
    crowded = {f: len(ns) - ("__init__.py" in ns) for f, ns in _tree().items()
               if len(ns) - ("__init__.py" in ns) > MAX_MODULES}
    assert not crowded, crowded


def _imports(name, path, mods):
    """The package modules `name` imports, at the top of its file or inside a function, relative or absolute."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    deps = set()
    for n in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - (n.level - 1)])
                target = base + ("." + n.module if n.module else "")
            elif (n.module or "").startswith("eagle3pipe"):
                target = n.module
            else:
                continue
            for a in n.names:  # `from .storage import files`: the module files; `from .files import x`: files
                deps.add(target + "." + a.name if target + "." + a.name in mods else target)
        elif isinstance(n, ast.Import):
            deps |= {a.name for a in n.names if a.name.startswith("eagle3pipe")}
    return {d for d in deps if d in mods and d != name}


def test_no_import_circles_in_the_package():
    """No module of eagle3pipe imports, even inside a function, a module that imports it back, directly or around
    a circle: each room's dependencies point one way."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}

    def reaches(a, b, seen):
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in graph[a])
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a, {b})})
    assert not circles, circles


def _wings():
    """docs/LAYOUT.md's wings table -> [(wing, kind, [modules])], bottom first."""
    rows = re.findall(r"^\| (\w+) \| (shared|stage) \| ([\w, ]+) \|$", _layout(), flags=re.M)
    return [(w, kind, [m.strip() for m in mods.split(",")]) for w, kind, mods in rows]


def test_every_import_follows_the_wings_rule():
    """Each wing of the table is its folder (adapters: the top level's adapters.py), with the modules it lists. A
    module imports only its own wing's modules or a shared wing's below it; no stage wing imports another. Inner
    imports count: an arrow hidden in a function is an arrow."""
    wings, tree = _wings(), _tree()
    assert [w for w, _, _ in wings if w != "adapters"] == sorted(set(tree) - {""}, key=[w for w, _, _ in wings].index)
    where = {}
    for rank, (wing, kind, members) in enumerate(wings):
        folder = "" if wing == "adapters" else wing
        have = sorted(n[:-3] for n in tree[folder] if n != "__init__.py" and (folder or n == "adapters.py"))
        assert sorted(members) == have, (wing, sorted(set(members) ^ set(have)))
        for m in members:
            where[f"eagle3pipe.{folder + '.' if folder else ''}{m}"] = (rank if kind == "shared" else len(wings), wing)
    mods = _modules()
    against = []
    for m in where:
        for d in _imports(m, mods[m], mods):
            if d not in where:
                continue
            (a, wa), (b, wb) = where[m], where[d]
            stage = a == len(wings)
            if (not stage and b > a) or (stage and b == a and wa != wb):
                against.append(f"{m} ({wa}) -> {d} ({wb})")
    assert not against, against


def _third_party_at_top(mods):
    """{module: whether importing it loads a library beyond the standard one (its top-level imports, transitively)}."""
    import sys
    tops = {}
    for m, path in mods.items():
        package = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        deps, outside = set(), False
        for n in ast.parse(open(path, encoding="utf-8").read()).body:
            for x in [n] if isinstance(n, (ast.Import, ast.ImportFrom)) else []:
                if isinstance(x, ast.ImportFrom) and x.level:
                    base = package.split(".")
                    target = ".".join(base[:len(base) - (x.level - 1)]) + ("." + x.module if x.module else "")
                    deps |= {target + "." + a.name if target + "." + a.name in mods else target for a in x.names}
                else:
                    names = [a.name for a in x.names] if isinstance(x, ast.Import) else [x.module or ""]
                    outside |= any(r.split(".")[0] not in sys.stdlib_module_names and not r.startswith("eagle3pipe")
                                   for r in names)
        tops[m] = (outside, deps & set(mods))
    memo = {}

    def loads(m, seen=()):
        if m not in memo:
            memo[m] = tops[m][0] or any(loads(d, seen + (m,)) for d in tops[m][1] if d not in seen)
        return memo[m]
    return {m: loads(m) for m in mods}


def test_imports_go_at_the_top_unless_a_library_would_load():
    """An import inside a function is one of a library beyond the standard one (torch, transformers, numpy: what a
    stage loads only once its checks pass), or of a module of ours that loads one, or it says why in a comment on its
    line. The standard library and our light modules are imported at the top, where the file's arrows show."""
    import sys
    mods = _modules()
    heavy = _third_party_at_top(mods)
    hidden = []
    for m, path in mods.items():
        src = open(path, encoding="utf-8").read()
        lines, package = src.splitlines(), m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for x in ast.walk(fn):
                if not isinstance(x, (ast.Import, ast.ImportFrom)) or "#" in lines[x.lineno - 1]:
                    continue
                if isinstance(x, ast.ImportFrom) and x.level:
                    base = package.split(".")
                    target = ".".join(base[:len(base) - (x.level - 1)]) + ("." + x.module if x.module else "")
                    ours = [target + "." + a.name if target + "." + a.name in mods else target for a in x.names]
                    if not any(heavy.get(d) for d in ours):
                        hidden.append(f"{m}:{x.lineno} {lines[x.lineno - 1].strip()}")
                else:
                    names = [a.name for a in x.names] if isinstance(x, ast.Import) else [x.module or ""]
                    if all(r.split(".")[0] in sys.stdlib_module_names for r in names):
                        hidden.append(f"{m}:{x.lineno} {lines[x.lineno - 1].strip()}")
    assert not hidden, hidden

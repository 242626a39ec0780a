"""Which verifier architectures the installed vLLM runs EAGLE-3 for, read from vLLM's own source without importing
it: importing vLLM takes seconds and prints, and the question must be answered before anything loads.

vLLM serves an eagle3 draft, and hands out auxiliary hidden states (stage 02's vLLM backend, stage 04 --online),
only for a verifier class that implements its `SupportsEagle3` interface: a base class of that name, or the
`supports_eagle3 = True` flag the interface checks. Gemma2 and Gemma3, among others, do not; their engine died after
loading the verifier ("Model does not support EAGLE3 interface"). The class comes from vLLM's registry
(architecture -> module, class), its bases are followed through the same module and `from .module import` lines.
Only a definite no refuses: an architecture the registry does not name or names twice, a class bound twice or with
a base that cannot be followed (a star import, a package's re-export, another library's mixin, a base chosen at
import time), and any installed vLLM plugin that may register classes, all answer "cannot tell".
"""
import ast
import functools
import importlib.metadata
import importlib.util
import os

from ..adapters import _dist

INTERFACE = "SupportsEagle3"


@functools.lru_cache(maxsize=None)
def _models_dir():
    spec = importlib.util.find_spec("vllm")  # a top-level package is located, not imported
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "model_executor", "models")
    return path if os.path.isdir(path) else None


@functools.lru_cache(maxsize=None)
def _tree(module):
    path = os.path.join(_models_dir(), f"{module}.py")
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None


IRRELEVANT = {"Module", "Protocol", "Generic", "object"}  # bases that hold nothing of EAGLE-3's


def _pair(v):
    if isinstance(v, ast.Tuple) and len(v.elts) == 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                             for e in v.elts):
        return v.elts[0].value, v.elts[1].value
    return None


@functools.lru_cache(maxsize=None)
def registry():
    """{architecture: (module, class)} from the literal mappings in vLLM's registry.py. An architecture given two
    different classes, or set anywhere but in a literal (`X["arch"] = ...`), maps to None: which one vLLM loads is
    not for the source alone to say."""
    tree = _tree("registry") if _models_dir() else None
    out = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and _pair(v):
                    out[k.value] = _pair(v) if out.get(k.value, _pair(v)) == _pair(v) else None
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                out[node.slice.value] = None
    return out


def _plugins():
    """Entry points that may register model classes with vLLM at run time, other than vLLM's own."""
    found = []
    for group in ("vllm.general_plugins", "vllm.platform_plugins"):
        found += [e for e in importlib.metadata.entry_points(group=group) if not e.value.startswith("vllm.")]
    return found


def _flagged(cls):
    """The class body sets `supports_eagle3 = True` (annotated or not)."""
    for stmt in cls.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else \
            stmt.target if isinstance(stmt, ast.AnnAssign) else None
        value = getattr(stmt, "value", None)
        if isinstance(target, ast.Name) and target.id == "supports_eagle3" and isinstance(value, ast.Constant) \
                and value.value is True:
            return True
    return False


def _module_level(stmts):
    """A module's statements, those under its top-level `if`, `try` and `with` blocks included."""
    for stmt in stmts:
        yield stmt
        if isinstance(stmt, (ast.If, ast.With, ast.Try)):
            yield from _module_level(stmt.body + getattr(stmt, "orelse", []) + getattr(stmt, "finalbody", [])
                                     + [x for h in getattr(stmt, "handlers", []) for x in h.body])


def _supports(module, name, depth=0):
    """True, False, or None (cannot tell) for class `name` of vLLM's model module `module`."""
    tree = _tree(module) if depth < 12 else None
    if tree is None:
        return None
    classes, imported, assigned, bound = {}, {}, set(), {}
    for node in _module_level(tree.body):
        names = []
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # a class made by a call (`as_seq_cls_model(...)`)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            assigned.update(names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level == 1 and source and "." not in source:
                where = source
            elif node.level == 0 and source.startswith("vllm.model_executor.models.") and source.count(".") == 3:
                where = source.rsplit(".", 1)[1]
            else:
                where = None  # a package, a sub-package, another library: not followed
            for alias in node.names:
                imported[alias.asname or alias.name] = (where, alias.name)
                names.append(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            names = [alias.asname or alias.name.split(".")[0] for alias in node.names]
        for n in names:
            bound[n] = bound.get(n, 0) + 1
    cls = classes.get(name)
    if cls is None or bound.get(name, 0) > 1:  # defined twice, or rebound: which one is the class is not ours to say
        return None
    if _flagged(cls):
        return True
    unknown = False
    for base in cls.bases:
        base = base.value if isinstance(base, ast.Subscript) else base  # Generic[T]
        if isinstance(base, ast.Name):
            base_name = base.id
        elif isinstance(base, ast.Attribute):  # `nn.Module`; `llama.LlamaForCausalLM` is not followed
            if base.attr == INTERFACE:
                return True
            unknown = unknown or base.attr not in IRRELEVANT
            continue
        else:
            unknown = True
            continue
        if imported.get(base_name, (None, base_name))[1] == INTERFACE:
            return True
        if base_name in assigned:  # chosen at import time (`if TYPE_CHECKING:` ... `else: Base = f(...)`)
            found = None
        elif base_name in classes and base_name != name:
            found = _supports(module, base_name, depth + 1)
        elif imported.get(base_name, (None,))[0]:
            found = _supports(*imported[base_name], depth + 1)
        elif base_name in IRRELEVANT:
            continue
        else:
            found = None  # a star import, a package's re-export, another library's mixin: cannot tell
        if found:
            return True
        unknown = unknown or found is None
    return None if unknown else False


def installed():
    """Whether a vLLM is installed here (located, not imported: importing it takes seconds and prints)."""
    return importlib.util.find_spec("vllm") is not None


def version():
    dist = _dist("vllm")  # the installed distribution, under either of vLLM's names
    return dist.version if dist else "?"


def eagle3_refusal(architecture):
    """Why the installed vLLM cannot run EAGLE-3 for `architecture` (config.json's), or None (it can, or it cannot
    be told: not installed, not in its registry)."""
    if not isinstance(architecture, str) or not _models_dir():
        return None
    entry = registry().get(architecture)
    if entry is None or _supports(*entry) is not False or _plugins():  # a plugin may register another class
        return None
    return (f"the installed vLLM ({version()}) has no EAGLE-3 support for {architecture} (its {entry[1]} does not "
            f"implement vLLM's {INTERFACE}): it can neither hand out its auxiliary hidden states nor serve an eagle3 "
            f"draft for it")

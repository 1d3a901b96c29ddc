"""The data path stays visible: no import cycle inside capskip_fx, no module importing another's
private names, and the layers of shared/design/layout.md (the base modules -- ops, records,
symbolic, placement, rows -- import only what lies below them; rules import torch only; neither the
runtime nor VCAS imports the passes).  Every import counts, module-level or inside a function."""
from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "capskip_fx"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> list[tuple[str, str, list[str], bool]]:
    """(importer, imported module, names, at module level?) for every import of capskip_fx code: every
    Import / ImportFrom node of every module, function-level ones included."""
    out = []
    for path in PKG.rglob("*.py"):
        mod = _module_name(path)
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        top = set(id(n) for n in tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "capskip_fx":
                    continue
                names = [a.name for a in node.names]
                for name in names:  # `from . import ops` imports a module, not the package's names
                    sub = f"{target}.{name}"
                    if (PKG.parent / (sub.replace(".", "/") + ".py")).exists() or \
                            (PKG.parent / sub.replace(".", "/")).is_dir():
                        out.append((mod, sub, [], id(node) in top))
                        names = [n for n in names if n != name]
                if names:
                    out.append((mod, target, names, id(node) in top))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "capskip_fx":
                        out.append((mod, a.name, [], id(node) in top))
    return out


def test_function_level_imports_are_seen():
    """The layer checks below read function-level imports too (config imports the rules late)."""
    late = [(src, dst) for src, dst, _, top in _imports() if not top]
    assert ("capskip_fx.config", "capskip_fx.rules") in late, f"function-level imports not collected: {late}"


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "function-level too"])
def test_no_import_cycle(module_level_only):
    """Every import is an edge: a late one inside a function, and a package's import of its own children
    (so a child that takes a name from its package's ``__init__``, late or not, closes a cycle)."""
    g = nx.DiGraph()
    for src, dst, _, top in _imports():
        if (top or not module_level_only) and src != dst:
            g.add_edge(src, dst)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_imported_across_modules():
    bad = [(src, dst, n) for src, dst, names, _ in _imports() for n in names
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, f"private names imported from another module: {bad}"


@pytest.mark.parametrize("low, forbidden", [
    ("capskip_fx.ops", ("capskip_fx.runtime", "capskip_fx.passes", "capskip_fx.backend", "capskip_fx.api")),
    ("capskip_fx.records", ("capskip_fx.runtime", "capskip_fx.passes", "capskip_fx.backend", "capskip_fx.api")),
    ("capskip_fx.passes", ("capskip_fx.backend", "capskip_fx.api", "capskip_fx.runtime")),
    ("capskip_fx.runtime", ("capskip_fx.backend", "capskip_fx.api", "capskip_fx.passes")),
    ("capskip_fx.rules", ("capskip_fx.runtime", "capskip_fx.passes", "capskip_fx.backend", "capskip_fx.api",
                          "capskip_fx.ops", "capskip_fx.vcas")),
    # the core data path knows nothing of VCAS (it sees a stateful compiled backward)
    ("capskip_fx.passes", ("capskip_fx.vcas",)),
    ("capskip_fx.runtime", ("capskip_fx.vcas",)),
    ("capskip_fx.vcas", ("capskip_fx.backend", "capskip_fx.api", "capskip_fx.train", "capskip_fx.passes")),
])
def test_layers_import_downward_only(low, forbidden):
    bad = [(src, dst) for src, dst, _, _ in _imports()
           if (src == low or src.startswith(low + ".")) and any(dst == f or dst.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{low} imports upward: {bad}"


@pytest.mark.parametrize("base, below", [
    ("capskip_fx.ops", ()),
    ("capskip_fx.records", ()),
    ("capskip_fx.symbolic", ("capskip_fx.records",)),
    ("capskip_fx.rows", ("capskip_fx.symbolic",)),
])
def test_base_modules_import_only_what_lies_below(base, below):
    bad = [(src, dst) for src, dst, _, _ in _imports() if src == base and dst not in below]
    assert not bad, f"{base} may import only {below}: {bad}"


# placement/'s modules, bottom first: each imports only the ones before it (and records, symbolic); the
# rules (ops_*) do not import each other's families above them, and prove.py, which imports them all, is last
PLACEMENT_PARTS = ["lattice", "tables", "registry", "walk", "ops_pointwise", "ops_reductions", "ops_shape",
                   "ops_indexing", "ops_matmul", "ops_per_sample", "ops_backward", "prove"]


def test_placement_parts_import_downward_only():
    """The placement proof is a base layer: it imports records and symbolic, and its parts only parts below."""
    mods = {_module_name(p) for p in (PKG / "placement").glob("*.py") if p.name != "__init__.py"}
    placed = {f"capskip_fx.placement.{m}" for m in PLACEMENT_PARTS}
    assert mods == placed, f"placement modules not in PLACEMENT_PARTS (or listed but gone): {sorted(mods ^ placed)}"
    rank = {f"capskip_fx.placement.{m}": i for i, m in enumerate(PLACEMENT_PARTS)}
    edges = [(src, dst) for src, dst, _, _ in _imports() if src in rank]
    assert ("capskip_fx.placement.prove", "capskip_fx.placement.walk") in edges, f"edges not collected: {edges}"
    upward = [(src, dst) for src, dst in edges if dst in rank and rank[dst] >= rank[src]]
    assert not upward, f"placement parts importing upward: {upward}"
    below = {"capskip_fx.records", "capskip_fx.symbolic"}
    outside = [(src, dst) for src, dst in edges if dst not in rank and dst not in below]
    assert not outside, f"placement parts importing outside records and symbolic: {outside}"


def test_rules_import_the_base_not_each_other():
    """A rule file imports rules.base and rules.labels; only StaleSB extends a sibling (SB with a cache), and
    Stale-SB's data-side filter sits beside its rule.  The registry is allowed (RandomSkip(match="sb") looks
    the name up in rules.registry), the package itself is not (it imports every rule)."""
    shared = {"capskip_fx.rules.base", "capskip_fx.rules.labels", "capskip_fx.rules.registry"}
    extends = {("capskip_fx.rules.stale_sb", "capskip_fx.rules.selective_backprop"),
               ("capskip_fx.rules.stale_sb_filter", "capskip_fx.rules.stale_sb")}
    bad = [(src, dst) for src, dst, _, _ in _imports()
           if src.startswith("capskip_fx.rules.") and dst.startswith("capskip_fx.rules")
           and dst not in shared and (src, dst) not in extends]
    assert not bad, f"rules importing a sibling rule: {bad}"


def test_every_rule_declares_whether_it_reads_labels():
    """The runtime reads ``Rule.needs_labels`` (no rule names): each registered rule sets it, and a random
    twin reads labels only through the rule it matches."""
    from capskip_fx.rules import RULES, RandomSkip, Rule

    undeclared = [name for name, cls in RULES.items()
                  if not any("needs_labels" in vars(c) for c in cls.__mro__ if c is not Rule)]
    assert not undeclared, f"rules that leave needs_labels to the default: {undeclared}"
    assert not RandomSkip(keep=0.5).needs_labels, "random with keep= reads no labels"
    assert not RandomSkip(match="dense").needs_labels, "random matching dense reads no labels"
    assert RandomSkip(match="capskip").needs_labels, "random matching capskip reads labels through it"


# runtime/'s parts, bottom first: each imports only parts before it (state.py composes them; backward.py
# is called by AOTAutograd and reads the state it is given: it asks plan.py for the step's plan and has
# executors.py carry it out)
RUNTIME_PARTS = ["stats", "forwards", "clock", "view", "checks", "published", "loss_grad", "state", "plan", "executors",
                 "backward"]


def test_runtime_parts_import_downward_only():
    """A new runtime module gets a place in RUNTIME_PARTS; no part imports one above it or the passes."""
    mods = {_module_name(p) for p in (PKG / "runtime").glob("*.py") if p.name != "__init__.py"}
    placed = {f"capskip_fx.runtime.{m}" for m in RUNTIME_PARTS}
    assert mods == placed, f"runtime modules not in RUNTIME_PARTS (or listed but gone): {sorted(mods ^ placed)}"
    rank = {f"capskip_fx.runtime.{m}": i for i, m in enumerate(RUNTIME_PARTS)}
    inner = [(src, dst) for src, dst, _, _ in _imports() if src in rank and dst in rank]
    assert ("capskip_fx.runtime.state", "capskip_fx.runtime.clock") in inner, f"edges not collected: {inner}"
    bad = [(src, dst) for src, dst in inner if rank[dst] >= rank[src]]
    assert not bad, f"runtime parts importing upward: {bad}"
    passes = [(src, dst) for src, dst, _, _ in _imports()
              if _within(src, "capskip_fx.runtime") and _within(dst, "capskip_fx.passes")]
    assert not passes, f"the runtime imports the passes (at module or function level): {passes}"


def test_library_compares_no_rule_names():
    """Rules declare what they need (``needs_labels``, a registered name's ``compile_options``): outside the
    harness no code compares a rule name (``rule == "vcas"``)."""
    from capskip_fx.rules import rule_names

    names = set(rule_names())
    bad = []
    for path in PKG.rglob("*.py"):
        if _within(_module_name(path), "capskip_fx.train"):
            continue
        src = path.read_text()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = [c.value for x in sides for c in (x.elts if isinstance(x, (ast.Tuple, ast.List, ast.Set)) else [x])
                      if isinstance(c, ast.Constant) and c.value in names]
            if consts and "rule" in ast.get_source_segment(src, node):
                bad.append(f"{_module_name(path)}:{node.lineno}: {ast.get_source_segment(src, node)}")
    assert not bad, f"rule names special-cased: {bad}"


def test_environment_is_read_in_config_only():
    """CAPSKIP_* (and any other) environment variables are read through config.py's helpers."""
    bad = []
    for path in PKG.rglob("*.py"):
        if path == PKG / "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ("environ", "getenv", "environb", "getenvb"):
                bad.append(f"{_module_name(path)}:{node.lineno}")
    assert not bad, f"environment read outside capskip_fx/config.py: {bad}"


def test_backend_reaches_vcas_through_its_entry_point_only():
    """VCAS is one subpackage with one entry point: the backend imports ``capskip_fx.vcas`` itself, the
    rest of the package at most its options (``vcas.controller.VCAS``)."""
    into = [(src, dst) for src, dst, _, _ in _imports()
            if dst.startswith("capskip_fx.vcas") and not src.startswith("capskip_fx.vcas")]
    assert into, "no module imports capskip_fx.vcas: the test would pass vacuously"
    bad = [(src, dst) for src, dst in into
           if not ((src == "capskip_fx.backend" and dst == "capskip_fx.vcas") or dst == "capskip_fx.vcas.controller")]
    assert not bad, f"reaching into VCAS past its entry point: {bad}"


def _within(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _dynamic_imports() -> list[tuple[str, str]]:
    """(importer, module) for ``importlib.import_module("capskip_fx...")`` / ``__import__`` with a literal name."""
    out = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith("capskip_fx"):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in ("import_module", "__import__"):
                    out.append((_module_name(path), node.args[0].value))
    return out


def test_library_never_imports_the_harness():
    """capskip_fx.train (the training harness, extra ``train``) sits on top: nothing else in the package
    imports it, at module or function level."""
    edges = [(src, dst) for src, dst, _, _ in _imports()] + _dynamic_imports()
    into = [(src, dst) for src, dst in edges if _within(dst, "capskip_fx.train")]
    assert into, "no import of capskip_fx.train found at all: the test would pass vacuously"
    bad = [(src, dst) for src, dst in into if not _within(src, "capskip_fx.train")]
    assert not bad, f"the library imports the harness: {bad}"


def test_integrations_sit_on_top():
    """integrations/ (trainer callbacks) import the public API only, and nothing in the library imports them."""
    into = [(src, dst) for src, dst, _, _ in _imports()
            if dst.startswith("capskip_fx.integrations") and not src.startswith("capskip_fx.integrations")]
    assert not into, f"library modules importing the integrations: {into}"
    below = [(src, dst) for src, dst, _, _ in _imports() if src.startswith("capskip_fx.integrations.")
             and dst.startswith("capskip_fx") and dst not in {"capskip_fx.api"}]
    assert not below, f"integrations reaching past capskip_fx.api: {below}"


def test_public_names_are_not_shadowed_by_submodules():
    """Importing a submodule binds its name on the package; a public name must not share a module's name
    (``capskip_fx.rowwise`` once resolved to the module, not the decorator, after backend.py loaded)."""
    import importlib
    import pkgutil

    import capskip_fx
    for m in pkgutil.walk_packages(capskip_fx.__path__, "capskip_fx."):
        if m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
        except ModuleNotFoundError as e:  # an integration whose optional extra is not installed
            assert not (e.name or "").startswith("capskip_fx"), e
    for name in capskip_fx.__all__:
        value = getattr(capskip_fx, name)
        assert not isinstance(value, type(capskip_fx)), f"capskip_fx.{name} is the module {value.__name__}"


def test_passes_see_graphs_and_contexts_only():
    """A pass is a function of its graph and a frozen context: no pass takes (or duck-types) the backend or
    the runtime state, and the result objects the pipeline returns are frozen."""
    import dataclasses

    from capskip_fx.passes import pipeline

    bad = []
    for path in (PKG / "passes").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                bad += [f"{path.name}:{node.name}({a.arg})" for a in args if a.arg in ("backend", "state")]
            if isinstance(node, ast.Attribute) and node.attr in ("backend", "state") \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                bad.append(f"{path.name}:{node.lineno} self.{node.attr}")
    assert not bad, f"passes holding the backend or runtime state: {bad}"
    for cls in (pipeline.JointContext, pipeline.JointResult, pipeline.BackwardContext, pipeline.BackwardResult):
        assert dataclasses.is_dataclass(cls), f"{cls.__name__} is not frozen"
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"

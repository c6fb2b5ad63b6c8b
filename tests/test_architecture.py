"""The shape of `src/fp8ax`: units (a flat module or a private subpackage) in layers, and
the rules that keep them apart.

Layers, bottom to top (a unit imports from its own layer or lower ones only; no cycle):

0. numerics and JAX plumbing;
1. values and state;
2. recipes;
3. GEMMs (settings, dimension numbers, kernels, the dense and the grouped custom VJPs);
4. modules and model layers (the ops, `Fp8Config`, the layers, the transform);
5. model-level functions: updates, microbatching, distribution, casting, calibration,
   checkpoints, reports, serving.

Rules, each checked on the real source and shown to fail on a planted violation:

- imports flow downwards, and no unit imports itself back through another (no cycle);
- no private name crosses units (`from ._x import _name`, or `_x._name` through a module),
  nor modules inside a unit (what a subpackage's modules share has a public name);
- recipes are leaves: a recipe module imports no other recipe, and only the public
  `__init__` and the default setting import a concrete recipe;
- `jax._src` only in the modules of `JAX_SRC`;
- Haliax only through its door (`_haliax`) and the model layer, imported at run time
  (inside functions, or for type checkers only); `tests/test_haliax.py` checks that
  `import fp8ax` loads neither Haliax, AQT nor Flax;
- docs/how-it-works.md lists the units layer by layer.
"""

import ast
import pathlib
import re

import pytest

import fp8ax

SRC = pathlib.Path(fp8ax.__file__).parent
DOCS = SRC.parents[1] / "docs" / "how-it-works.md"

UNITS = [
    [
        "_formats",
        "_rounding",
        "_mx",
        "_int8",
        "_tiles",
        "_hadamard",
        "_tensor_core",
        "_maxgrad",
        "_boundaries",
        "_haliax",
    ],
    ["_quantized", "_state", "_scaling_state"],
    ["_recipes"],
    ["_gemm"],
    ["_model"],
    [
        "_update",
        "_microbatch",
        "_distributed",
        "_cast",
        "_calibrate",
        "_checkpoint",
        "_inspect",
        "_serving",
    ],
    ["_kinds"],
]
# Recipe modules that are not a recipe: the interface, the stateless base and `quantize`.
RECIPE_SUPPORT = {"__init__", "base", "stateless", "applied"}
# Modules that may import a concrete recipe: the public API, and the default setting.
NAMES_A_RECIPE = {"__init__", "_gemm.settings"}
JAX_SRC = {"_boundaries", "_maxgrad"}
# Where Haliax may be imported at run time: its door and the model layer.
HALIAX_OK = {"_haliax", "_model"}


# ----------------------------------------------------------------------------- reading


def _source() -> dict[str, str]:
    """`{dotted module name relative to fp8ax: source}`, e.g. `_recipes.delayed`."""
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts)] = p.read_text()
    return out


def _unit(module: str) -> str:
    return module.split(".")[0]


def _resolve(module: str, node: ast.ImportFrom, source: dict[str, str]) -> tuple[str | None, list[str]]:
    """`(base, submodules)`: the fp8ax module an import-from reads from (relative name, or
    None for a package's own `from . import x` at the top, or a third-party import), and
    the fp8ax modules it imports by name (`from . import _formats`)."""
    if node.level == 0:
        if not (node.module or "").startswith("fp8ax"):
            return None, []
        base = node.module.split(".")[1:]
    else:
        pkg = module.split(".")[:-1]  # the package a module (or a package's __init__) sits in
        up = node.level - 1
        base = (pkg[: len(pkg) - up] if up else pkg) + (node.module.split(".") if node.module else [])
    subs = []
    for alias in node.names:
        sub = ".".join([*base, alias.name])
        if sub in source or f"{sub}.__init__" in source:
            subs.append(sub)
    return (".".join(base) or None), subs


class _Imports:
    """What one module imports: fp8ax modules, names taken from them, attribute reads
    through imported modules, and third-party roots (with whether at top level)."""

    def __init__(self, module: str, text: str, source: dict[str, str]):
        tree = ast.parse(text)
        self.modules: set[str] = set()
        self.names: list[tuple[str, str]] = []  # (from module, name)
        self.attributes: list[tuple[str, str]] = []  # (module, attribute)
        self.external: list[tuple[str, bool]] = []  # (dotted name, at run time at top level)
        aliases: dict[str, str] = {}
        type_checking = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                type_checking.update(id(n) for n in ast.walk(node))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 0 and not (node.module or "").startswith("fp8ax"):
                    if id(node) not in type_checking:
                        self.external.append((node.module or "", id(node) in top))
                    continue
                base, subs = _resolve(module, node, source)
                self.modules.update(([base] if base else []) + subs)
                for alias in node.names:
                    sub = ".".join(filter(None, [base, alias.name]))
                    if sub in subs:
                        aliases[alias.asname or alias.name] = sub
                    elif base:
                        self.names.append((base, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("fp8ax."):
                        self.modules.add(alias.name.split(".", 1)[1])
                    elif id(node) not in type_checking:
                        self.external.append((alias.name, id(node) in top))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                self.attributes.append((aliases[node.value.id], node.attr))


def _all_imports(source: dict[str, str]) -> dict[str, _Imports]:
    return {m: _Imports(m, text, source) for m, text in source.items()}


# ----------------------------------------------------------------------------- rules


def _layer_of() -> dict[str, int]:
    return {u: i for i, units in enumerate(UNITS) for u in units}


def unplaced(source: dict[str, str]) -> list[str]:
    layer = _layer_of()
    return sorted({_unit(m) for m in source if m != "__init__" and _unit(m) not in layer})


def upward(source: dict[str, str]) -> list[str]:
    layer = _layer_of()
    out = []
    for m, imp in _all_imports(source).items():
        if m == "__init__":
            continue
        for d in imp.modules:
            a, b = _unit(m), _unit(d)
            if a != b and b in layer and layer[b] > layer[a]:
                out.append(f"{m} (layer {layer[a]}) imports {d} (layer {layer[b]})")
    return sorted(out)


def unit_graph(source: dict[str, str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m, imp in _all_imports(source).items():
        if m == "__init__":
            continue
        graph.setdefault(_unit(m), set()).update(_unit(d) for d in imp.modules if _unit(d) != _unit(m))
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_crossings(source: dict[str, str]) -> list[str]:
    out = []
    for m, imp in _all_imports(source).items():
        for frm, name in imp.names + imp.attributes:
            if _unit(frm) != _unit(m) and _private(name) and f"{frm}.{name}" not in source:
                out.append(f"{m} uses {frm}.{name}")
    return sorted(out)


def private_inside_a_unit(source: dict[str, str]) -> list[str]:
    """Inside a subpackage, a module's private names are its own: what its siblings use
    of it has a public name (the package itself is private; its `__init__.py` says what
    the rest of fp8ax may use)."""
    out = []
    for m, imp in _all_imports(source).items():
        for frm, name in imp.names + imp.attributes:
            if frm != m and _unit(frm) == _unit(m) and _private(name) and f"{frm}.{name}" not in source:
                out.append(f"{m} uses {frm}.{name}")
    return sorted(out)


def _exports(source: dict[str, str], package: str) -> set[str]:
    """The names a subpackage's `__init__.py` binds: what the rest of fp8ax may use."""
    names = set()
    for node in ast.walk(ast.parse(source[f"{package}.__init__"])):
        if isinstance(node, ast.ImportFrom | ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def past_the_door(source: dict[str, str]) -> list[str]:
    """Another unit's subpackage is used through its `__init__.py` only, and only for
    what that `__init__.py` binds. (The public `fp8ax/__init__.py` and the default setting
    import the concrete recipes they name: see `recipe_leaks`.)"""
    packages = {m.rsplit(".", 1)[0] for m in source if m.endswith(".__init__") and "." in m}
    concrete = _concrete_recipes(source)
    out = []
    for m, imp in _all_imports(source).items():
        for d in imp.modules:
            if _unit(d) == _unit(m) or _unit(d) not in packages or d == _unit(d):
                continue
            if not (d in concrete and (m == "__init__" or m in NAMES_A_RECIPE)):
                out.append(f"{m} imports {d}, past `{_unit(d)}/__init__.py`")
        for frm, name in imp.names + imp.attributes:
            if _unit(frm) != _unit(m) and frm in packages and name not in _exports(source, frm):
                out.append(f"{m} uses {frm}.{name}, which `{frm}/__init__.py` does not export")
    return sorted(out)


def _concrete_recipes(source: dict[str, str]) -> set[str]:
    return {m for m in source if _unit(m) == "_recipes" and "." in m and m.split(".", 1)[1] not in RECIPE_SUPPORT}


def recipe_leaks(source: dict[str, str]) -> list[str]:
    concrete = _concrete_recipes(source)
    out = []
    for m, imp in _all_imports(source).items():
        for d in imp.modules & concrete:
            if m in concrete:
                out.append(f"recipe {m} imports recipe {d}")
            elif _unit(m) != "_recipes" and m not in NAMES_A_RECIPE:
                out.append(f"{m} imports the concrete recipe {d}")
        if _unit(m) == "_recipes" and m.split(".", 1)[-1] == "__init__" and imp.modules & concrete:
            out.append(f"{m} imports a concrete recipe ({sorted(imp.modules & concrete)})")
    return sorted(out)


def jax_src_users(source: dict[str, str]) -> list[str]:
    out = []
    for m, imp in _all_imports(source).items():
        if _unit(m) in JAX_SRC:
            continue
        out += [f"{m} imports {name}" for name, _ in imp.external if name == "jax._src" or name.startswith("jax._src.")]
    return sorted(out)


def haliax_imports(source: dict[str, str]) -> list[str]:
    out = []
    for m, imp in _all_imports(source).items():
        for name, top in imp.external:
            if name.split(".")[0] not in ("haliax", "aqt", "flax"):
                continue
            if _unit(m) not in HALIAX_OK:
                out.append(f"{m} imports {name} (only the door `_haliax` and the model layer may)")
            elif top:
                out.append(f"{m} imports {name} at import time (import it where a Haliax object is in hand)")
    return sorted(out)


# ----------------------------------------------------------------------------- the real source


def test_every_unit_has_a_layer():
    assert not unplaced(_source())


def test_imports_flow_downwards():
    assert not upward(_source())


def test_no_import_cycle_between_units():
    found = cycle(unit_graph(_source()))
    assert found is None, " -> ".join(found)


def test_no_private_name_crosses_units():
    assert not private_crossings(_source())


def test_no_private_name_crosses_modules_inside_a_unit():
    assert private_inside_a_unit(_source()) == []


def test_subpackages_are_used_through_their_door():
    assert not past_the_door(_source())


def test_recipes_are_leaves():
    source = _source()
    assert {m.split(".")[1] for m in _concrete_recipes(source)} >= {"delayed", "current", "mx", "nvfp4"}
    assert not recipe_leaks(source)


def test_jax_src_only_where_allowed():
    assert not jax_src_users(_source())


def test_haliax_only_through_its_door():
    assert not haliax_imports(_source())


def test_how_it_works_lists_the_units_layer_by_layer():
    text = DOCS.read_text()
    section = text[text.index("The source follows the same order") :]
    items = re.findall(r"^\d+\. (.*(?:\n   .*)*)", section[: section.index("\n\n", section.index("\n1. "))], re.M)
    named = [re.findall(r"`(_[a-z0-9_]+)/?`", item) for item in items]
    assert named == UNITS, named


# ----------------------------------------------------------------------------- planted violations


def _plant(module: str, line: str) -> dict[str, str]:
    source = _source()
    assert module in source, module
    source[module] = line + "\n" + source[module]
    return source


@pytest.mark.parametrize(
    "rule, module, line",
    [
        (upward, "_formats", "from ._state import ScalingState"),
        (upward, "_recipes.delayed", "from .._gemm import GemmSettings"),
        (private_crossings, "_update", "from ._state import _private_helper"),
        (private_crossings, "_inspect.stats", "from .. import _formats\nx = _formats._hidden"),
        (private_inside_a_unit, "_gemm.dense", "from .operands import _private_helper"),
        (private_inside_a_unit, "_serving.convert", "from . import codec\nx = codec._hidden"),
        (past_the_door, "_model.dot_general", "from .._gemm.dense import quantized_dot"),
        (past_the_door, "_update", "from ._gemm import Role"),
        (past_the_door, "_serving.ops", "from .. import _gemm\nx = _gemm.passes"),
        (recipe_leaks, "_recipes.mx", "from .delayed import DelayedScaling"),
        (recipe_leaks, "_update", "from ._recipes.current import CurrentScaling"),
        (recipe_leaks, "_recipes.__init__", "from .nvfp4 import NVFP4Scaling"),
        (jax_src_users, "_formats", "from jax._src import core"),
        (haliax_imports, "_state", "import haliax"),
        (haliax_imports, "_model.moe", "import haliax.nn as hnn"),
        (unplaced, "_formats", ""),
    ],
)
def test_each_rule_fails_on_a_planted_violation(rule, module, line):
    if rule is unplaced:
        source = _source()
        source["_newunit"] = "x = 1\n"
    else:
        source = _plant(module, line)
    assert rule(source), (rule.__name__, module, line)


def test_a_planted_cycle_is_found():
    graph = unit_graph(_source())
    assert "_formats" in graph["_state"]
    graph["_formats"].add("_state")
    assert cycle(graph) is not None
    # A cycle between units of one layer (each edge allowed on its own): the cycle rule
    # is what catches it.
    source = _plant("_formats", "from . import _rounding")
    assert "_formats" in unit_graph(source)["_rounding"] and not upward(source)
    assert cycle(unit_graph(source)) is not None
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None

"""The layout of `src/fp8ax`: imports flow one way, from the model-level functions down
to the numerics, and there is no import cycle.

Layers, bottom to top (a module may import from its own layer or lower ones only):

0. numerics: formats, rounding, MX elements, int8, GEMM layout bookkeeping, the
   max-accumulating dtype, the JAX rules that would sum the state, the host check;
1. values and state: `QuantizedArray`, `ScalingState`;
2. recipes (a module that defines a recipe and is not listed below is placed here: a
   recipe is a plug-in);
3. the GEMM pipeline and its settings;
4. modules: `Fp8DotGeneral`, `Fp8Config` (which builds them);
5. model-level functions: the transform (with `Fp8Linear`), updates, accumulation,
   distribution, casting, inspection, serving.
"""

import ast
import pathlib
import re

import fp8ax

SRC = pathlib.Path(fp8ax.__file__).parent

LAYERS = [
    {
        "_formats",
        "_rounding",
        "_mx",
        "_int8",
        "_layout",
        "_maxgrad",
        "_boundaries",
        "_haliax",
        "_accumulation",
    },
    {"_quantized", "_state"},
    {"_recipes", "_current"},
    {"_settings", "_pipeline"},
    {"_dot_general", "_ragged", "_config"},
    {
        "_transform",
        "_update",
        "_accumulate",
        "_distributed",
        "_cast",
        "_inspect",
        "_calibrate",
        "_report",
        "_stats",
        "_serving",
        "_checkpoint",
    },
]


def _imports(path: pathlib.Path) -> set[str]:
    """fp8ax modules `path` imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:
                out.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("fp8ax."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("fp8ax."))
    return out


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) for p in SRC.glob("_*.py") if p.stem != "__init__"}


_RECIPE_BASES = {"AbstractScalingRecipe", "AbstractStatelessRecipe"}


def _recipe_plugins() -> set[str]:
    """Modules outside LAYERS that define a recipe (a class deriving from one of the
    recipe base classes): a recipe is a plug-in, and its module sits in the recipe
    layer without being listed (docs/recipes.md, "Adding a recipe")."""
    listed = set().union(*LAYERS)
    out = set()
    for p in SRC.glob("_*.py"):
        if p.stem in listed or p.stem == "__init__":
            continue
        tree = ast.parse(p.read_text())
        bases = {
            b.id for n in ast.walk(tree) if isinstance(n, ast.ClassDef) for b in n.bases if isinstance(b, ast.Name)
        }
        if bases & _RECIPE_BASES:
            out.add(p.stem)
    return out


def _layers() -> list[set[str]]:
    layers = [set(mods) for mods in LAYERS]
    layers[2] |= _recipe_plugins()
    return layers


def test_every_module_has_a_layer():
    placed = set().union(*_layers())
    modules = set(_graph())
    assert modules <= placed, f"modules without a layer: {sorted(modules - placed)}"


def test_imports_flow_downwards():
    layer = {m: i for i, mods in enumerate(_layers()) for m in mods}
    upward = [
        f"{m} (layer {layer[m]}) imports {d} (layer {layer[d]})"
        for m, deps in _graph().items()
        for d in deps
        if d in layer and layer[d] > layer[m]
    ]
    assert not upward, upward


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
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


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_cycle_finder_finds_a_cycle():
    # The check above must be able to fail.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_how_it_works_lists_every_module_in_its_layer():
    # docs/how-it-works.md names the modules layer by layer, in the order of LAYERS.
    text = (SRC.parents[1] / "docs" / "how-it-works.md").read_text()
    paragraph = text[text.index("The source follows the same order") :]
    paragraph = paragraph[: paragraph.index("\n\n")]
    named = re.findall(r"`(_[a-z0-9_]+)`", paragraph)
    groups, i = [], 0
    for layer in LAYERS:
        groups.append(set(named[i : i + len(layer)]))
        i += len(layer)
    assert groups == LAYERS and i == len(named), named
    assert set(named) == {p.stem for p in SRC.glob("_*.py")} - {"__init__"} - _recipe_plugins()


def test_recipe_plugins_are_found():
    # `_blockwise` is listed nowhere: it is placed because it defines a recipe.
    assert "_blockwise" in _recipe_plugins() and "_blockwise" not in set().union(*LAYERS)

# `plot_amax_history`: a plot of the FP8 layers' amax histories, one panel per tensor.

import pathlib
from typing import Any

import jax
import numpy as np

from .._gemm import stateful_recipe
from .stats import ROLES, concrete, fp8_layers, index_str


def merge_identical(series: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray, str]]:
    """`(label, history)` pairs with equal histories merged into one `(labels, history,
    first label)`, labelled with all their names (`"attn.q_proj, attn.k_proj,
    attn.v_proj"`): layers that read the same input (the query, key and value
    projections) record the same amaxes, and their lines would hide one another."""
    merged: list[tuple[list[str], np.ndarray]] = []
    for label, history in series:
        for names, seen in merged:
            if seen.shape == history.shape and np.array_equal(seen, history):
                names.append(label)
                break
        else:
            merged.append(([label], history))
    return [(", ".join(names), history, names[0]) for names, history in merged]


def plot_amax_history(
    model: Any,
    path: str | pathlib.Path = "amax_history.png",
    *,
    tensors: tuple[str, ...] = ROLES,
    title: str | None = None,
) -> pathlib.Path:
    """Plots the amax history of every FP8 layer, one panel per tensor, and saves it.

    Each line is one layer (one stacked layer of a `haliax.nn.Stacked`), labelled by
    its path as in [`fp8ax.scaling_stats`][]. Layers whose histories of a tensor are
    equal (the query, key and value projections read the same input) are drawn as one
    line in that tensor's panel, labelled with all their paths; each panel has its own
    legend. The x axis counts steps back from the
    newest entry (0); entries not yet recorded (0 in the history) are left out. The y
    axis is logarithmic.

    Needs matplotlib (`pip install fp8ax[plot]`).

    **Arguments:**

    - `model`: a model with FP8 layers and a stateful recipe, outside `jax.jit`.
    - `path`: where to write the picture; the format follows the suffix (`.png`,
      `.svg`, `.pdf`). Missing parent folders are created.
    - `tensors`: which of `"lhs"`, `"rhs"`, `"grad"` to plot. (Keyword only argument.)
    - `title`: the figure's title. (Keyword only argument.)

    **Returns:**

    The path written, as a `pathlib.Path`.

    **Raises:**

    `ImportError` without matplotlib; `ValueError` if the model has no FP8 state.
    """
    tensors = tuple(tensors) if not isinstance(tensors, str) else (tensors,)
    bad = [t for t in tensors if t not in ROLES]
    if bad or not tensors:
        raise ValueError(f"`tensors` must name some of {ROLES}, got {tensors!r}.")
    series = {t: [] for t in tensors}
    for name, dg, _ in fp8_layers(model):
        for role in tensors:
            state = getattr(dg, role)
            if state is None:
                continue
            fields = tuple(concrete(v, "plot_amax_history") for v in jax.tree.leaves(state))
            history = stateful_recipe(dg.settings).state_history(fields)
            if history is None:
                continue
            for index in np.ndindex(*history.shape[:-1]):
                series[role].append((f"{name}{index_str(index)}", history[index]))
    if not any(series.values()):
        raise ValueError(
            "`model` has no FP8 state to plot: no `fp8ax.Fp8DotGeneral` with a stateful recipe "
            "(`fp8ax.DelayedScaling`). Convert it with `fp8ax.fp8_linear_layers` first."
        )
    try:
        # The object-oriented API only: no pyplot, so the user's backend and figures are untouched.
        import matplotlib
        import matplotlib.ticker
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "`fp8ax.plot_amax_history` needs matplotlib: `pip install fp8ax[plot]` (or `pip install matplotlib`)."
        ) from e
    lines = {role: merge_identical(s) for role, s in series.items()}
    # A layer keeps its colour in every panel (a merged line takes its first layer's).
    order = {label: k for k, label in enumerate(dict.fromkeys(lb for s in series.values() for lb, _ in s))}
    n_lines = len(order)
    fig = Figure(figsize=(8, 2.6 * len(tensors) + 0.4))
    axes = fig.subplots(len(tensors), 1, sharex=True, squeeze=False)
    colors = matplotlib.colormaps["tab20" if n_lines > 10 else "tab10"]
    for ax, role in zip(axes[:, 0], tensors):
        for label, history, first in lines[role]:
            recorded = np.nonzero(history > 0)[0]
            color = colors(order[first] % colors.N)
            ax.plot(-recorded, history[recorded], label=label, color=color, linewidth=1.0)
        ax.set_yscale("log")
        ax.set_ylabel(f"{role} amax")
        ax.grid(alpha=0.3, which="both")
        # One legend per panel: layers that share a tensor are one line in its panel only.
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False)
    axes[-1, 0].set_xlabel("step, relative to the newest entry (0)")
    axes[-1, 0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path

# `Fp8MoELinear`: a `haliax.nn.MoELinear` whose grouped GEMM is an `Fp8RaggedDot`.

from __future__ import annotations

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PRNGKeyArray

if TYPE_CHECKING:
    import haliax as hax
    import haliax.nn as hnn

from .. import _haliax
from .ragged_dot import Fp8RaggedDot


class Fp8MoELinear(eqx.Module):
    """A `haliax.nn.MoELinear` whose grouped GEMM is an [`fp8ax.Fp8RaggedDot`][]: what
    [`fp8ax.fp8_linear_layers`][] makes of one. Same fields (`weight`, `bias`,
    `Experts`, `In`, `Out`, `use_gmm`) and call (`layer(inputs, group_sizes)`), plus
    `ragged`, the FP8 op with its state.

    Both `use_gmm` settings run the same op: XLA's ragged dot on the quantized operands.
    (`use_gmm=True` selects Haliax's Pallas grouped-matmul kernel, which takes no FP8
    scales; the setting is kept so that [`fp8ax.strip_fp8`][] gives the layer back as it
    was.)
    """

    weight: hax.NamedArray
    bias: hax.NamedArray | None
    ragged: Fp8RaggedDot
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True)

    @classmethod
    def from_moe_linear(cls, layer: hnn.MoELinear, make_ragged) -> Fp8MoELinear:
        """`layer` with an FP8 grouped GEMM; `make_ragged(batch_shape, num_experts)`
        builds the [`fp8ax.Fp8RaggedDot`][]."""
        experts, in_axis, out_axis = (_one_axis(layer, name) for name in ("Experts", "In", "Out"))
        own = {experts.name, in_axis.name, out_axis.name}
        batch_shape = tuple(ax.size for ax in layer.weight.axes if ax.name not in own)
        ragged = make_ragged(batch_shape, experts.size)
        return cls(layer.weight, layer.bias, ragged, experts, in_axis, out_axis, layer.use_gmm)

    def to_moe_linear(self) -> hnn.MoELinear:
        """The plain `haliax.nn.MoELinear` with the same weights (the FP8 state dropped)."""
        return _haliax.hnn().MoELinear(self.weight, self.bias, self.Experts, self.In, self.Out, use_gmm=self.use_gmm)

    @jax.named_scope("fp8ax.Fp8MoELinear")
    def __call__(
        self, inputs: hax.NamedArray, group_sizes: hax.NamedArray, *, key: PRNGKeyArray | None = None
    ) -> hax.NamedArray:
        """**Arguments:**

        - `inputs`: (..., In), the tokens grouped by expert along their other axes
          (flattened in order).
        - `group_sizes`: (Experts,), the number of tokens for each expert.
        - `key`: not used.
        """
        del key
        w = self.weight.rearrange((self.Experts, self.In, self.Out)).array
        return moe_call(self, inputs, group_sizes, lambda x, sizes: self.ragged(x, w, sizes))


def moe_call(layer, inputs: hax.NamedArray, group_sizes: hax.NamedArray, grouped) -> hax.NamedArray:
    """`haliax.nn.MoELinear`'s call with its grouped GEMM replaced by `grouped(x, sizes)`
    on the tokens flattened to (M, In) and the (Experts,) group sizes."""
    hax = _haliax.hax()
    x = inputs.rearrange((..., layer.In))
    lead = x.axes[:-1]
    rows = int(np.prod([ax.size for ax in lead], dtype=np.int64))
    sizes = group_sizes.rearrange((..., layer.Experts)).array
    out = grouped(x.array.reshape(rows, layer.In.size), sizes)
    q = hax.named(out.reshape(tuple(ax.size for ax in lead) + (layer.Out.size,)), lead + (layer.Out,))
    q = q.rearrange(hax.replace_axis(inputs.axes, layer.In, layer.Out))
    if layer.bias is not None:
        q = q + layer.bias
    return hax.auto_sharded(q)


def _one_axis(layer: hnn.MoELinear, name: str) -> hax.Axis:
    """`layer.<name>` (`Experts`, `In`, `Out`), which fp8ax converts only as one axis."""
    axis = getattr(layer, name)
    if not _haliax.is_axis(axis):
        raise TypeError(f"fp8ax converts `haliax.nn.MoELinear` layers whose `{name}` is one axis, got {axis!r}.")
    return axis

# Planning a call's stateful operands: a stateful recipe computes on the states of the
# operands it quantizes in one call together, in the forward pass (`plan_call`), and the
# output scale of each GEMM whose operands' scales are known from the state alone is
# computed beside them.

import numpy as np
from jax import lax

from .._formats import fenced
from .call import ROLES, Call, by_recipe, float32_of, grad_once, is_16_bit_float, is_fp8_dtype, role_dtype
from .settings import Role, stateful_recipe


def plan_call(call: Call, states: dict) -> tuple[dict, dict]:
    """Each stateful operand's plan (see `AbstractStatefulRecipe.plan`): a recipe plans
    the operands it quantizes with state in this call, forward ones and the gradient,
    together, in the forward pass.

    Also the output scale of each GEMM whose two operands have planned scales (known
    from the state alone, delayed scaling after its first call) and whose scales go into
    its epilogue: their product, computed here beside the scales. The plans and the
    products go behind one optimization barrier (not on CPU: `_formats.fenced`). Without
    it XLA:GPU merges the scalar arithmetic of a cast's scale with that of the next state
    (which reads the tensor's amax), and the FP8 cast waits on the reduction of its own
    input; and a product computed next to its GEMM is a kernel of its own on the
    cuBLASLt path."""
    plans = dict.fromkeys(ROLES)
    roles = [r for r in ROLES if states[r] is not None]
    if "fwd" in call.settings.high_precision_gemms:
        roles = [r for r in roles if r == "grad"]
    if not grad_once(call):
        roles = [r for r in roles if r != "grad"]
    for _, idx in by_recipe(call, roles):  # (a state's recipe is the settings' own)
        planned = stateful_recipe(call.settings).plan(
            [states[roles[i]] for i in idx], [role_dtype(call, roles[i]) for i in idx]
        )
        plans.update((roles[i], p) for i, p in zip(idx, planned))
    scales = planned_scales(call, plans)
    if all(s is None for s in scales.values()):
        return plans, {}
    products = {}
    for name, a, b, out_dtype in _gemms(call):
        sa, sb = scales.get(a), scales.get(b)
        if sa is not None and sb is not None and _epilogue_scaled(call, name, a, b, out_dtype):
            products[name] = lax.mul(float32_of(sa), float32_of(sb))
    return fenced((plans, products))


# The three GEMMs of a call: (name, its operands in order, the dtype it writes).
def _gemms(call: Call) -> tuple[tuple[str, Role, Role, np.dtype], ...]:
    return (
        ("fwd", "lhs", "rhs", call.out_dtype),
        ("dlhs", "grad", "rhs", call.lhs_dtype),
        ("drhs", "lhs", "grad", call.rhs_dtype),
    )


def planned_scales(call: Call, plans: dict) -> dict:
    """Each role's planned scale (`AbstractStatefulRecipe.planned_scale`), None where
    the role has no plan or its recipe plans no scale."""
    return {r: None if plans[r] is None else stateful_recipe(call.settings).planned_scale(plans[r]) for r in ROLES}


def _epilogue_scaled(call: Call, name: str, a: Role, b: Role, out_dtype) -> bool:
    """Whether GEMM `name` runs on two FP8 operands with tensor-wise scales and puts
    their product into its epilogue (`run_gemm`'s first branch), as far as the settings
    tell; `run_gemm` checks the operands themselves."""
    st = call.settings
    if st.mode != "direct" or name in st.high_precision_gemms:
        return False
    return is_fp8_dtype(role_dtype(call, a)) and is_fp8_dtype(role_dtype(call, b)) and is_16_bit_float(out_dtype)

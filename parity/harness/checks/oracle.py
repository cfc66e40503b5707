"""The float64 oracle of one (case, dtype) unit: forward, gradients and gradient floors, per masked-row policy.

Each answer is computed once per unit (per policy and dtype judged) from the unit's rounded inputs, and
comes with its yardstick: the same maths with each stage rounded to the dtype judged
(`parity.tolerances.yardstick_dtype`), whose error is the largest of its runs' (`yardstick_runs`, `envelope`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mha_spec import AttentionConfig
from parity import reference
from parity.canonical import LAYER_FIELDS
from parity.dtypes import numpy_dtype
from parity.tolerances import (TOLERANCES, envelope, errors, gradient_floors, reduction_floors, yardstick_dtype,
                               yardstick_runs)


@dataclass
class Oracle:
    """The oracle of one unit: `shape` its layer's (`matrix.Shape`), `x` its inputs (`matrix.Inputs`) in the run
    dtype `dtype`, which every answer defaults to judging at."""

    shape: object
    x: object
    dtype: str
    exact: dict = field(default_factory=dict)  # policy -> float64 intermediates
    low: dict = field(default_factory=dict)  # (policy, at) -> the yardstick's intermediates
    grads: dict = field(default_factory=dict)  # (policy, masked_row_grads) -> float64 gradients
    yard: dict = field(default_factory=dict)  # (policy, masked_row_grads, at) -> the yardstick's errors per key
    terms: dict = field(default_factory=dict)  # (policy, masked_row_grads, per_query_head, yardstick dtype) -> bias terms
    memo: dict = field(default_factory=dict)  # a check's own oracles (`cached`)

    def args64(self):
        """(state dict, query, key, value), float64."""
        x = self.x
        sd = {k: reference.as_float64(v) for k, v in x.state_dict.items()}
        return sd, *(reference.as_float64(a) for a in (x.query, x.key, x.value))

    def layer_kw(self) -> dict:
        """The oracle's keywords for the case's layer beyond the state dict (which says the biases, the head
        dim and the sinks)."""
        s = self.shape
        return {"num_heads": s.N, "num_kv_heads": s.num_kv_heads, "rope": s.rope, "rope_theta": s.rope_theta,
                **layer_fields(s), **self.x.position_kw}

    def cached(self, key, make):
        """`make()` computed once per unit under `key`: a check's own oracle (the decode check's)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def forward(self, policy: str, at: str | None = None):
        """(float64 intermediates, the yardstick judged at `at` (default: the run dtype)), on the rounded inputs."""
        at = at or self.dtype
        if policy not in self.exact or (policy, at) not in self.low:
            sd, q, k, v = self.args64()
            kw = {**self.layer_kw(), "masked_rows": policy}
            if policy not in self.exact:
                self.exact[policy] = reference.forward(sd, q, k, v, self.x.keep, **kw)
            runs = yardstick_runs(lambda sd, xs, dt: reference.forward(sd, *xs, self.x.keep, dtype=dt, **kw), sd,
                                  (q, k, v), at)
            self.low[(policy, at)] = envelope(self.exact[policy], runs)
        return self.exact[policy], self.low[(policy, at)]

    def gradients(self, policy: str, masked_row_grads: str = "stop", at: str | None = None):
        """(float64 gradients, per-key errors of the yardstick judged at `at` (default: the run dtype)).

        masked_row_grads: what the implementation declares its fully masked rows do ("stop" | "flow")."""
        at = at or self.dtype
        key = (policy, masked_row_grads)
        if key not in self.grads or (*key, at) not in self.yard:
            sd, q, k, v = self.args64()
            cot = reference.as_float64(self.x.cotangent)
            kw = {**self.layer_kw(), "masked_rows": policy, "masked_row_grads": masked_row_grads}
            if key not in self.grads:
                self.grads[key] = reference.backward(sd, q, k, v, self.x.keep, cot, **kw)
            runs = yardstick_runs(lambda sd, xs, dt: reference.backward(sd, *xs[:3], self.x.keep, xs[3], dtype=dt, **kw),
                                  sd, (q, k, v, cot), at)
            exact = self.grads[key]
            self.yard[(*key, at)] = {n: max(errors(run[n], exact[n])[0] for run in runs) for n in exact}
        return self.grads[key], self.yard[(*key, at)]

    def bias_terms(self, policy: str, masked_row_grads: str = "stop", per_query_head: bool = False,
                   at: str | None = None) -> dict[str, np.ndarray]:
        """{bias gradient: its per-token terms (B·L, F), float64}: the gradient of that projection's output
        at each token, which the bias gradient sums (out_proj's: the cotangent), as the oracle's own maths in
        the run dtype stores it (`reference.backward(dtype=...)`). Read off the oracle with each input
        projection moved into its input -- x·Wᵀ + b fed as the input (zero-padded to E columns; `_moved_projections`),
        weight [I | 0], bias 0: the same layer and the same stored values, whose input gradient is then the
        projection's output gradient. per_query_head=True: on a grouped layer, k_proj's and v_proj's terms
        are each query head's share (B·G·S, F) before the sum over its group, which XLA folds into the
        same float16 reduction when it fuses repeat_kv's transpose with the bias gradient's sum.
        at: the dtype judged (default the run dtype): the terms are stored as its yardstick stores them."""
        sd, *xs = self.args64()
        cot = reference.as_float64(self.x.cotangent)
        widths = {n: sd[f"{n}.weight"].shape[0] for n in ("q_proj", "k_proj", "v_proj") if f"{n}.bias" in sd}
        terms = {}
        if widths:  # a layer without q/k/v biases needs no second backward
            moved, inputs, cot_in = _moved_projections(sd, xs, cot)
            kw = {**self.layer_kw(), "masked_rows": policy, "masked_row_grads": masked_row_grads}
            grads = reference.backward(moved, *inputs, self.x.keep, cot_in, dtype=numpy_dtype(yardstick_dtype(at or self.dtype)),
                                       per_query_head=per_query_head, **kw)
            terms = {f"{n}.bias": grads[key][..., :widths[n]].reshape(-1, widths[n])
                     for n, key in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")) if n in widths}
            for n, key in (("k_proj", "key"), ("v_proj", "value")):
                shares = grads.get(f"{key}.per_query_head")  # (B, K, G, S, H)
                if n in widths and shares is not None and shares.shape[2] > 1:
                    terms[f"{n}.bias"] = shares.transpose(0, 2, 3, 1, 4).reshape(-1, widths[n])  # (B·G·S, K·H)
        if "out_proj.bias" in sd:
            terms["out_proj.bias"] = cot.reshape(-1, cot.shape[-1])
        return terms

    def floors(self, policy: str, masked_row_grads: str, expected: dict, at: str | None = None) -> dict[str, float]:
        """The gradient floors (parity.tolerances) of the dtype judged, `at` (default the run dtype): a true-zero
        gradient's, and each bias gradient's bound when its sum over tokens runs in the dtype -- over the
        tokens, or on a grouped layer's k/v biases over each query head's share of them
        (`bias_terms(per_query_head=True)`) -- the largest where several apply."""
        at = at or self.dtype
        floors = gradient_floors(expected, at)
        if TOLERANCES[at].three_way_k is None:
            return floors
        grouped = (self.shape.num_kv_heads or self.shape.N) < self.shape.N
        for per_query_head in (False, True) if grouped else (False,):
            key = (policy, masked_row_grads, per_query_head, yardstick_dtype(at))
            if key not in self.terms:
                self.terms[key] = self.bias_terms(policy, masked_row_grads, per_query_head, at)
            for n, f in reduction_floors(self.terms[key], expected, at).items():
                floors[n] = max(f, floors.get(n, 0.0))
        return floors


__all__ = ["Oracle", "layer_fields", "LAYER_KEYWORDS"]


def _moved_projections(sd: dict, xs, cot):
    """(state dict, inputs, cotangent) of the same layer with q/k/v_proj moved into the inputs: input
    x·Wᵀ + b (B, L, F) zero-padded to E' = max(E, F) columns, weight [I | 0] (F, E'), bias 0. A head dim of
    its own can make F = N·H > E: out_proj then gets E' - E zero rows (and bias entries), the cotangent
    zero columns, so the output's extra columns are 0 and change no gradient."""
    E = sd["q_proj.weight"].shape[1]
    wide = max(E, *(sd[f"{n}.weight"].shape[0] for n in ("q_proj", "k_proj", "v_proj")))
    moved, inputs = dict(sd), []
    for name, x in zip(("q_proj", "k_proj", "v_proj"), xs):
        W, b = sd[f"{name}.weight"], sd.get(f"{name}.bias")  # (F, E), (F,)
        F = W.shape[0]
        out = x @ W.T + (0.0 if b is None else b)  # (B, L, F)
        inputs.append(np.concatenate([out, np.zeros((*out.shape[:2], wide - F))], axis=-1))  # (B, L, E')
        moved[f"{name}.weight"] = np.eye(F, wide)
        if b is not None:
            moved[f"{name}.bias"] = np.zeros(F)
    if wide == E:
        return moved, inputs, cot
    moved["out_proj.weight"] = np.concatenate([sd["out_proj.weight"], np.zeros((wide - E, sd["out_proj.weight"].shape[1]))])
    if "out_proj.bias" in sd:
        moved["out_proj.bias"] = np.concatenate([sd["out_proj.bias"], np.zeros(wide - E)])
    return moved, inputs, np.concatenate([cot, np.zeros((*cot.shape[:2], wide - E))], axis=-1)


# The AttentionConfig fields a case's layer passes by name beyond the sizes, heads, biases, rope, rope_theta,
# head_dim and sinks: those the tensors cannot say (`parity.canonical.LAYER_FIELDS`) and RoPE's partial rotary
# and scaling (once each, should LAYER_FIELDS come to name them too).
LAYER_KEYWORDS = tuple(dict.fromkeys((*LAYER_FIELDS, "rope_dim", "rope_scaling")))


def layer_fields(shape) -> dict:
    """The layer's `LAYER_KEYWORDS` not at their defaults: the oracle's (and our modules') keywords for
    QK-norm, the scale, the soft-cap, partial rotary (rope_dim) and scaled RoPE (rope_scaling)."""
    return {f: getattr(shape, f) for f in LAYER_KEYWORDS if getattr(shape, f) != getattr(AttentionConfig, f)}

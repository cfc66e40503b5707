"""Measure what the real libraries' attention does: mask polarity, fully masked rows, softmax precision.

Beyond mha-bench, which times and never asks what a library computes: this measures behaviour, and
beyond `mha-parity --checks peers`, which judges each peer under the convention its adapter declares,
it measures which convention the library itself has (the evidence behind those declarations).

    .venv/bin/python scripts/measure_ecosystem.py            # ~17 s of CPU; prints a Markdown table

Every library runs through its peer adapter in parity/peers/ (hf.py, keras.py, equinox.py) on the
same random weights (E=12, N=3, B=3, T=5, S=7 for cross-attention, seeds fixed) and is compared with
the float64 oracle (parity/reference.py):

- polarity: the keep-mask as the adapter translates it (its own convention) vs the same
  keep-mask inverted; the error against the oracle on the rows that keep something
  tells which polarity the library reads (small for the right one, O(1) for the other).
- fully masked row: the row that attends to nothing vs the oracle's three policies
  ('nan', 'zero', 'uniform' = mean of V); the matching policy has error ~0 (or NaN == NaN).
- softmax precision: the float64 run's max error against the float64 oracle with no mask
  (~1e-16: float64 all the way; ~1e-8: a float32 stage), and the 16-bit runs' error as a
  multiple of the oracle's own maths in that dtype (the tolerance table's yardstick).
"""

from __future__ import annotations

import argparse
import functools

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from parity import convert, reference  # noqa: E402
from parity.peers import equinox, hf, keras  # noqa: E402
from parity.peers.common import np_dtype  # noqa: E402
from parity.tolerances import errors  # noqa: E402

E, N, B, T, S = 12, 3, 3, 5, 7
MASKED = (0, 1)  # (batch, query) of the fully masked row

# name -> (adapter, cross-attention?)
LIBRARIES = {
    "HF BERT (BertSelfAttention + output.dense, eager)": (hf.hf_bert_attention_forward, False),
    "HF ViT (ViTAttention, eager)": (hf.hf_vit_attention_forward, False),
    "HF GPT-2 (GPT2Attention, eager)": (hf.hf_gpt2_attention_forward, False),
    "Keras 3 MultiHeadAttention (JAX backend), default call": (keras.keras_mha_forward, True),
    "Keras 3, return_attention_scores=True": (functools.partial(keras.keras_mha_forward, return_attention_scores=True), True),
    "Equinox MultiheadAttention": (equinox.equinox_mha_forward, True),
}


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    sd = {f"{p}.{w}": rng.uniform(-0.5, 0.5, (E, E) if w == "weight" else (E,)) for p in convert.PROJECTIONS for w in ("weight", "bias")}
    q, k, v = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E)), rng.standard_normal((B, S, E))
    return rng, sd, q, k, v


def _call(fn, cross, sd, q, k, v, keep, dtype):
    if cross:
        return fn(sd, N, q, k, v, keep, dtype)
    return fn(sd, N, q, keep, dtype)


def _keep(rng, name, cross):
    """A keep-mask with one fully masked row; GPT-2's must be causal & padding (left padding does it)."""
    if "GPT-2" in name:
        pad = np.ones((B, T), bool)
        pad[MASKED[0], : MASKED[1] + 1] = False  # query MASKED[1] sees only padded keys
        return hf.gpt2_keep_mask(pad)
    keep = rng.random((B, T, S if cross else T)) > 0.4
    keep[..., 0] = True
    keep[MASKED[0], MASKED[1], :] = False
    return keep


def _policy_of(row, oracle_rows) -> str:
    """Which masked-row policy the library's fully masked row follows ('nan', 'zero', 'uniform') or its error."""
    if np.isnan(row).all():
        return "NaN"
    errs = {p: errors(row, e)[0] for p, e in oracle_rows.items() if p != "nan"}
    best = min(errs, key=errs.get)
    return f"{best} ({errs[best]:.1g})" if errs[best] < 1e-3 else f"none (closest {best}: {errs[best]:.2g})"


def measure(name, fn, cross, seed=0) -> dict:
    rng, sd, q, k, v = _inputs(seed)
    k, v = (k, v) if cross else (q, q)
    keep = _keep(rng, name, cross)
    gpt2 = "GPT-2" in name
    unmasked = hf.gpt2_keep_mask(np.ones((B, T), bool)) if gpt2 else None  # GPT-2 is never unmasked: plain causal

    def oracle(keep, policy="uniform", dtype=np.float64):
        return reference.forward(sd, q, k, v, keep, num_heads=N, masked_rows=policy, dtype=dtype).output

    row = {"library": name}
    live = keep.any(-1)  # polarity is judged on the rows that keep something
    out = _call(fn, cross, sd, q, k, v, keep, "float64")
    row["err, mask as translated"] = errors(out[live], oracle(keep)[live])[0]
    if not gpt2:  # GPT-2's adapter takes only causal masks
        inverted = ~keep
        inverted[..., 0] = True
        row["err, mask inverted"] = errors(out[live], oracle(inverted)[live])[0]
    b, t = MASKED
    for dt in ("float64", "float32"):
        got = _call(fn, cross, sd, q, k, v, keep, dt)[b, t].astype(np.float64)
        row[f"masked row ({dt})"] = _policy_of(got, {p: oracle(keep, p)[b, t] for p in ("nan", "zero", "uniform")})
    exact = oracle(unmasked)
    row["float64 err"] = errors(_call(fn, cross, sd, q, k, v, unmasked, "float64"), exact)[0]
    row["float32 err"] = errors(_call(fn, cross, sd, q, k, v, unmasked, "float32"), exact)[0]
    for dt in ("bfloat16", "float16"):
        yard = errors(oracle(unmasked, dtype=np_dtype(dt)), exact)[0]
        row[f"{dt} err / yardstick"] = errors(_call(fn, cross, sd, q, k, v, unmasked, dt), exact)[0] / yard
    return row


def _fmt(x):
    return x if isinstance(x, str) else f"{x:.2g}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds per library; the worst value is printed")
    args = parser.parse_args()
    rows = []
    for name, (fn, cross) in LIBRARIES.items():
        per_seed = [measure(name, fn, cross, seed) for seed in range(args.seeds)]
        worst = dict(per_seed[0])
        for r in per_seed[1:]:
            for key, val in r.items():
                if isinstance(val, float) and isinstance(worst.get(key), float):
                    worst[key] = max(worst[key], val)
        rows.append(worst)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c, "n/a")) for c in cols) + " |")


if __name__ == "__main__":
    main()

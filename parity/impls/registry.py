"""The registry: what an implementation is, every built-in one, and loading the user's own.

Framework-free: a benchmark's parent process and the harness's planning read this
table without importing torch or jax; the factories it names are imported lazily.

The adapter contract (the same for ours, the peers and a user's own layer):

    factory(state_dict, num_heads, *, dtype, device[, masked_rows][, problem]) -> fn
    fn(params, query, key, value, mask[, *, positions, key_positions]) -> output | (output, weights)

`state_dict` is the canonical dict of NumPy arrays (`parity.convert` names, torch
layout, already in `dtype`); `dtype` is its name ("float32", ...); `device` is the
framework's device (a `torch.device` or a `jax.Device`). `masked_rows` is passed only
to implementations whose policy is configurable (`masked_rows=None`). `params` is
that state dict as framework arrays on `device` — the harness differentiates with
respect to it, so `fn` must compute with it (a module can be called through
`torch.func.functional_call`); with `uses_params=False` the signature is
`fn(query, key, value, mask)` and parameter gradients are not checked.
query (B, T, E), key and value (B, S, E); `mask` follows the declared convention
(`mask`, `mask_shape`) or is None; output (B, T, E) in the inputs' dtype;
weights (B, N, T, S) when `returns_weights`.

Attention variants (`mha_spec.VARIANT_FEATURES`: "grouped", "rope-half",
"rope-interleaved", "no-qkv-bias", "no-out-bias") are declared in `variants`, the
features the implementation runs. A case whose layer uses a feature not declared is a
skip row naming it, for every check (`Implementation.unsupported`). The default, no
declaration (`variants=()`), is the classic layer and the classic call above: a layer
written before variants existed runs unchanged and skips the variant cases. An
implementation that declares at least one feature also receives the problem:
`problem` (keyword) is an `mha_spec.Problem` — `problem.config` the layer (num_heads,
num_kv_heads, biases, rope, rope_theta, and its masked_rows policy) and problem.B/T/S
the sizes of the case. Weights follow `problem.config.weight_shapes()`: k/v (K·H, E),
absent biases absent from `state_dict` and `params`. On a RoPE case `fn` (and
`fn.intermediates`) also get `positions=` (B, T) and `key_positions=` (B, S), integer
framework arrays (torch int64, JAX int32), the positions the oracle rotates by (not the
default arange); elsewhere neither keyword is passed. A peer's `fn.vjp(input, mask,
cotangent)` gets them as NumPy arrays, as keywords, likewise.

Optionally `fn.intermediates(params, query, key, value, mask) -> dict` with any of
q (B, N, T, H), k, v (B, K, S, H), q_rot (B, N, T, H) and k_rot (B, K, S, H) (after RoPE),
scores, weights (B, N, T, S), context (B, T, N·H), output (a dict, or a dataclass such
as `mha_spec.Stages`): then a failing check names the first stage where it leaves the
oracle, in the order q, k, v, q_rot, k_rot, scores, weights, context, output (so a
projection bug, a RoPE bug and a key/value-head bug are told apart). Stages are
judged as reported: scores are compared where the oracle's key is kept on a row that
attends to something (so -inf, finfo.min or unmasked values at masked places all pass);
weights, context and output everywhere. A stage of another shape than the oracle's (a
k with N heads, repeated before it is reported) is named with both shapes.

`fn` must not change its arguments: the harness checks after every call that the inputs
and parameters it passed are bit for bit what they were (a change is a fail row).

What an implementation supports is declared, never guessed: `dtypes` (None: every dtype)
and `variants` make the other units skip rows that say so. `Implementation.unsupported(dtype,
config)` is the one place that reads these declarations, and every check (and the
benchmark) skips by it alike.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mha_spec import MASKED_ROWS_POLICIES, VARIANT_FEATURES, AttentionConfig, Problem

FRAMEWORKS = ("torch", "jax")
MODES = ("eager", "jit", "compile")
MASK_CONVENTIONS = ("keep", "drop", "additive")
MASK_SHAPES = ("B1TS", "BNTS", "BTS")
ROLES = ("ours", "peer", "user")
INPUTS = ("qkv", "self")


def unit_kind(cross: bool, mask: str, dtype: str) -> str:
    """"<self|cross>/<mask kind>/<dtype>": what `Implementation.runs_on` patterns match."""
    return f"{'cross' if cross else 'self'}/{mask}/{dtype}"


@dataclass(frozen=True)
class Implementation:
    """One attention implementation in one execution mode, and how to talk to it.

    name             unique; what reports call it
    framework        "torch" | "jax"
    factory          callable, or "module:attribute" imported when first built
    mode             "eager" | "jit" (JAX: the harness and the benchmark jax.jit it) | "compile" (torch.compile)
    returns_weights  fn returns (output, weights [B, N, T, S]); else output alone (or (output, None))
    masked_rows      the policy its fully masked rows follow ("nan" | "zero" | "uniform");
                     None: configurable, the factory takes masked_rows=
    mask             "keep" (True/1 = attend) | "drop" (True = masked out) | "additive" (0 / -inf, in the dtype)
    mask_shape       "B1TS" (B, 1, T, S) | "BNTS" (B, N, T, S) | "BTS" (B, T, S)
    uses_params      fn takes the parameters as its first argument (see the module docstring)
    role             "ours" | "peer" | "user"
    family, bench    the benchmark's `impl` column (default: name) and whether it is benchmarked by default
    harness          whether `mha-parity` runs it (the benchmark-only variants of peers do not)
    materializes     builds a (B, N, T, S) score tensor at any length (None: when it returns weights);
                     the benchmark skips what cannot fit
    masked_row_grads how its gradients treat a fully masked row: "stop" (a constant row: no gradient
                     reaches its scores, as a select where(keep, scores, fill) gives) | "flow" (the row
                     is differentiated as a softmax, as when the mask is ADDED to the scores: with
                     "uniform", HF's finfo.min; with "nan", -inf, whose NaN then reaches the query and
                     key gradients, as torch.nn.MultiheadAttention's). The gradient oracle follows it.
    dtypes           the dtypes it supports (e.g. ("float32", "bfloat16")); None: all. Units in
                     other dtypes are skip rows naming the declaration (see `unsupported`)
    variants         the `mha_spec.VARIANT_FEATURES` it runs (e.g. ("grouped", "rope-half",
                     "no-qkv-bias", "no-out-bias") for a Llama port); () the classic layer only.
                     Declaring any feature makes the factory take `problem=` and `fn` take the
                     positions on RoPE cases (see the module docstring)
    classic          whether it also runs the classic layer (no feature used); False for a peer of
                     the variant layers whose classic twin is a peer of its own (keras-gqa, keras-mha)
    runs_on          where it runs, in every check and the benchmark: fnmatch patterns over a unit's kind
                     "<self|cross>/<mask kind>/<dtype>" (mask kinds: none, padding, causal, random);
                     None: everywhere. What it can express (HF BERT is self-attention: "self/*/*";
                     GPT-2 also causal: "self/causal/*") or what is worth the time. Elsewhere: a skip row.
    inputs           "qkv": fn(params, query, key, value, mask, ...) | "self": fn(params, x, mask, positions=None),
                     one input for query, key and value (self-attention layers: Llama, BERT, GPT-2); its input
                     gradient is judged against the sum of the oracle's query, key and value gradients, and
                     cross-attention cases are skip rows saying why
    requires         the `mha_spec.VARIANT_FEATURES` its layer always has (a Llama port: ("grouped", "rope-half",
                     "no-qkv-bias", "no-out-bias")): it runs only on layers with every one of them (they are
                     added to `variants`); `parity.harness` builds such cases when the selected set has none
    computes_in      the dtype it really computes in when its inputs are wider (e.g. "float32": a float32 softmax
                     in a float64 model): units of a wider dtype are judged at this dtype's bound, the row says
                     so, and the stage search uses the same bound; None: the inputs' dtype
    names            a `parity.layouts` layout (e.g. "hf-llama"): `params` (and fn.intermediates') arrive under
                     that layout's names, without prefix (q_proj.weight, o_proj.weight, ...); gradients reach
                     the canonical tensors through the renaming. None: the canonical names
    """

    name: str
    framework: str
    factory: Callable | str
    mode: str = "eager"
    returns_weights: bool = False
    masked_rows: str | None = "nan"
    mask: str = "keep"
    mask_shape: str = "B1TS"
    uses_params: bool = True
    role: str = "user"
    family: str = ""
    bench: bool = True
    harness: bool = True
    materializes: bool | None = None
    doc: str = ""
    runs_on: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    masked_row_grads: str = "stop"
    variants: tuple[str, ...] = ()
    classic: bool = True
    inputs: str = "qkv"
    requires: tuple[str, ...] = ()
    computes_in: str | None = None
    names: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"implementation name must be a non-empty string without spaces, got {self.name!r}")
        for attr, allowed in (("framework", FRAMEWORKS), ("mode", MODES), ("mask", MASK_CONVENTIONS),
                              ("mask_shape", MASK_SHAPES), ("role", ROLES)):
            if getattr(self, attr) not in allowed:
                raise ValueError(f"implementation {self.name!r}: {attr}={getattr(self, attr)!r} is not one of {allowed}")
        if self.masked_rows is not None and self.masked_rows not in MASKED_ROWS_POLICIES:
            raise ValueError(f"implementation {self.name!r}: masked_rows={self.masked_rows!r} is not one of "
                             f"{MASKED_ROWS_POLICIES} (or None for configurable)")
        if self.mode == "compile" and self.framework != "torch":
            raise ValueError(f"implementation {self.name!r}: mode 'compile' is torch.compile; JAX uses 'jit'")
        if not (callable(self.factory) or isinstance(self.factory, str)):
            raise TypeError(f"implementation {self.name!r}: factory must be callable or 'module:attribute'")
        if self.runs_on is not None and (not isinstance(self.runs_on, tuple) or not all(
                isinstance(k, str) and k.count("/") == 2 for k in self.runs_on)):
            raise TypeError(f"implementation {self.name!r}: runs_on must be a tuple of '<self|cross>/<mask kind>/<dtype>' "
                            f"patterns (e.g. ('self/causal/*',)), got {self.runs_on!r}")
        if self.masked_row_grads not in ("stop", "flow"):
            raise ValueError(f"implementation {self.name!r}: masked_row_grads={self.masked_row_grads!r} is not "
                             "'stop' or 'flow'")
        if self.dtypes is not None:
            from parity.dtypes import DTYPES

            if not isinstance(self.dtypes, tuple) or not self.dtypes or any(d not in DTYPES for d in self.dtypes):
                raise ValueError(f"implementation {self.name!r}: dtypes must be a non-empty tuple of {DTYPES} "
                                 f"(or None for all), got {self.dtypes!r}")
        for attr in ("variants", "requires"):
            value = getattr(self, attr)
            if not isinstance(value, tuple) or any(v not in VARIANT_FEATURES for v in value):
                raise ValueError(f"implementation {self.name!r}: {attr} must be a tuple of {VARIANT_FEATURES} "
                                 f"(() for {'the classic layer only' if attr == 'variants' else 'none'}), got {value!r}")
        if self.requires:  # a layer that always has a feature runs it, and never the classic layer
            variants = tuple(f for f in VARIANT_FEATURES if f in self.variants or f in self.requires)
            object.__setattr__(self, "variants", variants)
            object.__setattr__(self, "classic", False)
        self._check_edges()

    def _check_edges(self) -> None:
        """inputs, computes_in, names: what the layer is called with and computes in."""
        if self.inputs not in INPUTS:
            raise ValueError(f"implementation {self.name!r}: inputs={self.inputs!r} is not one of {INPUTS}")
        if self.inputs == "self" and not self.uses_params:
            raise ValueError(f"implementation {self.name!r}: inputs='self' is fn(params, x, mask, ...): it needs "
                             "uses_params=True")
        if self.computes_in is not None:
            from parity.dtypes import DTYPES

            if self.computes_in not in DTYPES:
                raise ValueError(f"implementation {self.name!r}: computes_in={self.computes_in!r} is not one of {DTYPES}")
        if self.names is not None:
            from parity.layouts import LAYOUTS

            if self.names not in LAYOUTS:
                raise ValueError(f"implementation {self.name!r}: names={self.names!r} is not a layout parity.layouts "
                                 f"knows: {LAYOUTS}")
            if not self.uses_params:
                raise ValueError(f"implementation {self.name!r}: names= renames the params fn takes: it needs "
                                 "uses_params=True")

    def unsupported(self, dtype: str, config: AttentionConfig | None = None, *, cross: bool | None = None,
                    mask: str | None = None) -> str | None:
        """Why it does not run a unit of this dtype, layer, attention kind and mask, by its own declarations
        (None: it runs). The one place every check and the benchmark skip by.

        config: the unit's layer (None: the classic one); its `features` must all be declared in `variants`
        and hold every one of `requires`. cross: cross-attention (query apart from key/value); mask: the
        unit's mask kind; with both known, `runs_on` decides too.
        """
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"{self.name} declares dtypes={','.join(self.dtypes)}: {dtype} is not among them"
        if cross and self.inputs == "self":
            return (f"{self.name} declares inputs='self' (one input for query, key and value): cross-attention "
                    "needs the query apart from the keys and values")
        if cross is not None and mask is not None and not self.runs(unit_kind(cross, mask, dtype)):
            return (f"{self.name} runs only where its runs_on matches the <self|cross>/<mask>/<dtype> of the unit "
                    f"({unit_kind(cross, mask, dtype)}): {', '.join(self.runs_on)}")
        if self.requires:
            if config is not None and not isinstance(config, AttentionConfig):
                raise TypeError(f"unsupported: config must be an mha_spec.AttentionConfig, got {type(config).__name__}")
            lacking = [f for f in self.requires if config is None or f not in config.features]
            if lacking:
                return f"{self.name} requires {', '.join(self.requires)}: this layer lacks {', '.join(lacking)}"
        if config is not None:
            if not isinstance(config, AttentionConfig):
                raise TypeError(f"unsupported: config must be an mha_spec.AttentionConfig, got {type(config).__name__}")
            if not self.classic and not config.features:
                return (f"{self.name} runs the layers of its variants ({','.join(self.variants)}) only: "
                        "the classic layer has a peer of its own")
            missing = [f for f in VARIANT_FEATURES if f in config.features and f not in self.variants]
            if missing:
                declared = f"variants={','.join(self.variants)}" if self.variants else "no variants (the classic layer only)"
                return (f"{self.name} declares {declared}: this layer uses {', '.join(missing)}, "
                        f"which it does not run")
        return None

    def judged_at(self, dtype: str) -> str:
        """The dtype whose bound judges a unit of `dtype`: `computes_in` where it is coarser, else `dtype`."""
        if self.computes_in is None:
            return dtype
        from parity.dtypes import numpy_dtype
        import ml_dtypes

        eps = lambda d: float(ml_dtypes.finfo(numpy_dtype(d)).eps)  # noqa: E731
        return self.computes_in if eps(self.computes_in) > eps(dtype) else dtype

    @property
    def takes_problem(self) -> bool:
        """Whether the factory takes `problem=` and fn the positions: it declares a variant."""
        return bool(self.variants)

    def runs(self, kind: str) -> bool:
        """Whether the peers check runs it on a unit of this kind ("self/causal/float32", ...)."""
        import fnmatch

        return self.runs_on is None or any(fnmatch.fnmatchcase(kind, p) for p in self.runs_on)

    @property
    def materializes_scores(self) -> bool:
        return self.returns_weights if self.materializes is None else self.materializes

    @property
    def bench_key(self) -> str:
        """The benchmark's row key: family:mode:weights|fused."""
        return f"{self.family or self.name}:{self.mode}:{'weights' if self.returns_weights else 'fused'}"

    def policy(self, case_policy: str) -> str:
        """The masked-row policy it runs with in a case: its own, or the case's when configurable."""
        return case_policy if self.masked_rows is None else self.masked_rows

    def make(self, state_dict: dict, num_heads: int, masked_rows: str, device, problem: Problem | None = None) -> Callable:
        """Call the factory as the contract says (masked_rows only when configurable, problem only when
        it declares variants); check it gave a callable.

        problem: the unit's `mha_spec.Problem`; required for an implementation that declares variants,
        and its layer must be the one the state dict describes.
        """
        kw = {"dtype": next(iter(state_dict.values())).dtype.name, "device": device}
        if self.masked_rows is None:
            kw["masked_rows"] = masked_rows
        if problem is not None and not isinstance(problem, Problem):
            raise TypeError(f"{self.name}: problem must be an mha_spec.Problem, got {type(problem).__name__}")
        if problem is not None:
            why = self.unsupported(kw["dtype"], problem.config)
            if why:
                raise ValueError(why)
            expected = problem.config.weight_shapes()
            got = {k: tuple(np.shape(v)) for k, v in state_dict.items()}
            if got != expected:
                raise ValueError(f"{self.name}: the state dict {got} is not the problem's layer {expected}")
        if self.takes_problem:
            if problem is None:
                raise TypeError(f"{self.name} declares variants={','.join(self.variants)}: build it with "
                                "problem= (an mha_spec.Problem: the layer and its sizes)")
            kw["problem"] = problem
        fn = self.resolve_factory()(state_dict, num_heads, **kw)
        if not callable(fn):
            raise TypeError(f"{self.name}: the factory returned {type(fn).__name__}, not a callable")
        if self.inputs != "qkv" or self.names is not None:
            from parity.impls.adapt import to_contract

            fn = to_contract(self, fn)
        return fn

    def resolve_factory(self) -> Callable:
        if callable(self.factory):
            return self.factory
        obj = _import_attr(self.factory)
        if not callable(obj):
            raise TypeError(f"implementation {self.name!r}: {self.factory} is not callable")
        return obj


def implementation(**declared):
    """Decorator for a user's factory: `@implementation(name=..., framework=..., mask=..., ...)`.

    Returns the `Implementation` (with the decorated function as its factory), so
    `mha-parity --impl my_pkg.my_module:my_factory` finds everything it needs.
    """
    declared.setdefault("role", "user")

    def wrap(factory):
        return Implementation(factory=factory, **{"name": factory.__name__, **declared})

    return wrap


class LoadError(ValueError):
    """A user implementation ('module:attribute') could not be loaded; the message is one line
    naming the module and what went wrong. Both command-line tools make it a usage error (exit 2)."""


def _import_attr(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise LoadError(f"{spec!r} is not 'module:attribute' (e.g. parity.examples.jax_port:port)")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name.split(".")[0] or os.getcwd() in sys.path:
                raise
            # As `python -m` would: a module or package in the current directory.
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit at import included: a module that does not load is a usage error
        raise LoadError(f"cannot load {spec!r}: importing module {module_name!r} raised {_one_line(e)}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LoadError(f"cannot load {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, SystemExit):
        text = f"exit status {e.code!r}"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_user_impl(spec: str) -> tuple[Implementation, ...]:
    """'module:attribute' -> the Implementation(s) it names (one, or a tuple/list of them).

    Any failure to load -- an exception or a SystemExit at import, a missing attribute,
    an object that is not an Implementation -- is a `LoadError` (a ValueError) with a
    one-line message naming the module.
    """
    obj = _import_attr(spec)
    items = obj if isinstance(obj, (tuple, list)) else (obj,)
    if not items or not all(isinstance(i, Implementation) for i in items):
        raise LoadError(
            f"cannot load {spec!r}: it is {type(obj).__name__}, not a parity.impls.Implementation: declare it with "
            f"@parity.impls.implementation(framework=..., mask=..., masked_rows=..., returns_weights=...)"
        )
    return tuple(items)


# ---------------------------------------------------------------- masks


def mask_for(impl: Implementation, keep: np.ndarray | None, num_heads: int, dtype: np.dtype):
    """The case's keep-mask (B, 1, T, S) bool, in the implementation's convention (NumPy)."""
    if keep is None:
        return None
    if keep.ndim != 4 or keep.shape[1] != 1:
        raise ValueError(f"keep-mask must be (B, 1, T, S), got {keep.shape}")
    if impl.mask_shape == "BNTS":
        keep = np.broadcast_to(keep, (keep.shape[0], num_heads, *keep.shape[2:]))
    elif impl.mask_shape == "BTS":
        keep = keep[:, 0]
    keep = np.ascontiguousarray(keep)
    if impl.mask == "drop":
        return ~keep
    if impl.mask == "additive":
        return np.where(keep, 0.0, -np.inf).astype(dtype)
    return keep


def layer_kwargs(state_dict: dict, num_heads: int, problem: Problem | None) -> dict:
    """num_kv_heads, rope, rope_theta for our modules' converters (`parity.convert.to_torch/to_jax`):
    the problem's; without one, the state dict's key/value heads (k_proj rows / H) and no RoPE."""
    if problem is not None:
        c = problem.config
        return {"num_kv_heads": c.num_kv_heads, "rope": c.rope, "rope_theta": c.rope_theta}
    q_rows, kv_rows = np.shape(state_dict["q_proj.weight"])[0], np.shape(state_dict["k_proj.weight"])[0]
    K = kv_rows * num_heads // q_rows if q_rows else num_heads
    return {"num_kv_heads": None if K == num_heads else K}


# ---------------------------------------------------------------- built-ins

# computes_in="float32" (measured, seed 0, default matrix): jax.nn.dot_product_attention's float64
# output is ~1e-8 off the float64 oracle (its softmax always runs in float32), Keras 3's default call
# runs it too (2.2e-7 off), jax-dpa-gqa and keras-gqa are the same kernel with K heads; HF Llama (eager)
# computes RoPE's cos/sin and its softmax in float32 for float64 models (2e-8..5e-8 off,
# tests/test_modern_peers.py).

# The default matrix's causal self-attention case has peers=True for GPT-2 (causal only); the
# framework peers skip it to keep the default run within a minute (~3 s of CPU, measured).
_FRAMEWORK_PEER_CASES = ("cross/*/*", "self/none/*", "self/padding/*", "self/random/*")

_T = "parity.impls.torch_impls"
_J = "parity.impls.jax_impls"
_E = "parity.impls.ecosystem_impls"


# What our modules run (mha_spec.VARIANT_FEATURES): both run every variant.
_OURS_VARIANTS = {"torch": VARIANT_FEATURES, "jax": VARIANT_FEATURES}


def _ours(name, framework, factory, mode, weights, doc, **kw):
    return Implementation(name, framework, factory, mode, weights, masked_rows=None, role="ours",
                          family=f"ours-{framework}", doc=doc, variants=_OURS_VARIANTS[framework], **kw)


BUILTIN = (
    _ours("torch", "torch", f"{_T}:ours_weights", "eager", True, "mha_torch.MultiHeadAttention"),
    _ours("torch-fused", "torch", f"{_T}:ours_fused", "eager", False, "mha_torch, need_weights=False (SDPA)"),
    _ours("torch-compile", "torch", f"{_T}:ours_weights", "compile", True, "torch.compile(mha_torch.MultiHeadAttention)"),
    _ours("torch-compile-fused", "torch", f"{_T}:ours_fused", "compile", False, "torch.compile(mha_torch), need_weights=False"),
    _ours("jax", "jax", f"{_J}:ours_weights", "eager", True, "mha_jax.MultiHeadAttention, op by op", bench=False),
    _ours("jax-jit", "jax", f"{_J}:ours_weights", "jit", True, "mha_jax.MultiHeadAttention under jax.jit"),
    _ours("jax-fused", "jax", f"{_J}:ours_fused", "jit", False, "mha_jax, need_weights=False, under jax.jit"),
    Implementation("torch-mha", "torch", f"{_T}:torch_mha_weights", returns_weights=True, masked_rows="nan", mask="drop",
                   role="peer", runs_on=_FRAMEWORK_PEER_CASES, masked_row_grads="flow",
                   doc="torch.nn.MultiheadAttention(batch_first=True), average_attn_weights=False; "
                   "bool attn_mask True = masked out (added as -inf); softmax of all -inf gives NaN rows, "
                   "and their NaN reaches the query and key gradients"),
    Implementation("torch-mha-fused", "torch", f"{_T}:torch_mha_fused", masked_rows="zero", mask="drop", role="peer",
                   family="torch-mha", harness=False, doc="torch.nn.MultiheadAttention, need_weights=False (SDPA fast path)"),
    Implementation("torch-sdpa-core", "torch", f"{_T}:sdpa_core", masked_rows="zero", role="peer", runs_on=_FRAMEWORK_PEER_CASES,
                   doc="the same projections around F.scaled_dot_product_attention; bool mask True = attend; "
                   "fully masked rows give 0"),
    Implementation("flax-linen-mha", "jax", f"{_J}:flax_linen", "jit", True, masked_rows="uniform", role="peer", runs_on=_FRAMEWORK_PEER_CASES, bench=False,
                   doc="flax.linen.MultiHeadDotProductAttention; mask True = attend; masked scores are finfo.min, "
                   "so empty rows are uniform"),
    Implementation("flax-nnx-mha", "jax", f"{_J}:flax_nnx_weights", "jit", True, masked_rows="uniform", role="peer", runs_on=_FRAMEWORK_PEER_CASES,
                   doc="flax.nnx.MultiHeadAttention, sow_weights=True; mask True = attend; empty rows uniform"),
    Implementation("flax-nnx-mha-fused", "jax", f"{_J}:flax_nnx_fused", "jit", False, masked_rows="uniform", role="peer",
                   family="flax-nnx-mha", harness=False, materializes=True, doc="flax.nnx.MultiHeadAttention without weights"),
    Implementation("jax-dpa-core", "jax", f"{_J}:dpa_core", "jit", False, masked_rows="uniform", computes_in="float32",
                   role="peer", runs_on=_FRAMEWORK_PEER_CASES, materializes=True,
                   doc="the same projections around jax.nn.dot_product_attention (XLA); mask True = attend; "
                   "softmax always in float32 (also for float64 inputs)"),
    # The real libraries (the optional `.[ecosystem]` extra; absent: a skip row). Forward only:
    # their modules hold their own weights. What they do, as measured: parity.ecosystem's docstring.
    Implementation("hf-bert", "torch", f"{_E}:hf_bert", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, role="peer", bench=False, runs_on=("self/*/*",), masked_row_grads="flow",
                   doc="transformers BertAttention (self + output.dense), eager; additive mask 0 / finfo.min, "
                   "so empty rows are uniform, and their gradient flows into the query and key gradients"),
    Implementation("hf-gpt2", "torch", f"{_E}:hf_gpt2", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, role="peer", bench=False, runs_on=("self/causal/*",), masked_row_grads="flow",
                   doc="transformers GPT2Attention, eager; causal by its mask (create_causal_mask), "
                   "a query with only padding is uniform over all keys"),
    # Keras and Equinox run op by op: each new dtype costs ~0.5 s of compiles (measured), so
    # the default run checks them in float64/float32 (16-bit measured at 1.3-1.5x the yardstick).
    Implementation("keras-mha", "jax", f"{_E}:keras_mha", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, computes_in="float32", role="peer", bench=False, runs_on=("*/*/float64", "*/*/float32"),
                   doc="keras.layers.MultiHeadAttention (JAX backend), default call = jax.nn.dot_product_attention; "
                   "bool mask True = attend; empty rows uniform; float32 softmax in float64 runs"),
    Implementation("equinox-mha", "jax", f"{_E}:equinox_mha", masked_rows="uniform", mask_shape="BTS",
                   uses_params=False, role="peer", bench=False, runs_on=("*/*/float64", "*/*/float32"),
                   doc="equinox.nn.MultiheadAttention, vmapped; bool mask True = attend; masked scores finfo.min, "
                   "so empty rows are uniform"),
    # Peers for grouped/multi-query, rotary and bias-free layers (each RoPE its own code, not our modules').
    # float64/float32: 16-bit adds compiles and transformers calls to the default run and proves no more.
    Implementation("torch-sdpa-gqa", "torch", "parity.impls.gqa_torch:sdpa_gqa", masked_rows="zero", role="peer",
                   bench=True, runs_on=("*/*/float64", "*/*/float32"), variants=VARIANT_FEATURES,
                   doc="our projections around F.scaled_dot_product_attention(enable_gqa=True) on the K key/value "
                   "heads, RoPE by its own rotate_half/rotate_every_two; bool mask True = attend; empty rows give 0"),
    # Each unit of jax-dpa-gqa is two XLA compiles (forward, gradients): it runs on the masks and
    # attention kinds the default matrix's classic peer cases lack (there it is jax-dpa-core's kernel).
    Implementation("jax-dpa-gqa", "jax", "parity.impls.gqa_jax:dpa_gqa", "jit", False, masked_rows="uniform",
                   computes_in="float32", role="peer", bench=True, materializes=True,
                   runs_on=("cross/*/float64", "cross/*/float32", "self/padding/float64", "self/padding/float32"),
                   variants=VARIANT_FEATURES,
                   doc="our projections around jax.nn.dot_product_attention with K key/value heads, RoPE as complex "
                   "pairs; mask True = attend; empty rows uniform; softmax in float32 (also for float64 inputs)"),
    # Keras's GroupQueryAttention has no RoPE and one use_bias for all four projections: it runs
    # grouped layers with every bias (a bias-free one skips: "no-qkv-bias" alone is not its layer).
    Implementation("keras-gqa", "jax", f"{_E}:keras_gqa", "jit", False, masked_rows="uniform", mask_shape="BTS",
                   computes_in="float32", role="peer", bench=True, materializes=True, runs_on=("*/*/float64", "*/*/float32"),
                   variants=("grouped",), classic=False,
                   doc="keras.layers.GroupQueryAttention (JAX backend) on the canonical parameters via stateless_call; "
                   "key/value heads repeated per group (ops.repeat), then jax.nn.dot_product_attention: bool mask "
                   "True = attend, empty rows uniform, float32 softmax in float64 runs"),
    # HF Llama in float64: a fully masked row is NaN there (finfo(float64).min is -inf in its float32
    # softmax), uniform elsewhere; so float64 runs only the masks without one (none, causal self-attention).
    Implementation("hf-llama", "torch", f"{_E}:hf_llama", masked_rows="uniform", mask_shape="BTS", uses_params=False,
                   computes_in="float32", role="peer", bench=False, masked_row_grads="flow", variants=VARIANT_FEATURES,
                   runs_on=("self/none/*", "self/causal/*", "self/*/float32", "self/*/bfloat16", "self/*/float16"),
                   doc="transformers LlamaAttention (eager) with LlamaRotaryEmbedding, position_ids = the positions; "
                   "additive mask 0 / finfo.min, so empty rows are uniform and their gradient flows; cos/sin and softmax "
                   "in float32 (also for float64); interleaved RoPE via HF's q/k row permutation, absent biases as zeros"),
)
_BY_NAME = {i.name: i for i in BUILTIN}


def builtin(name: str) -> Implementation:
    if name not in _BY_NAME:
        raise ValueError(f"unknown implementation {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def select(role: str | None = None) -> tuple[Implementation, ...]:
    """The built-ins of a role ("ours" | "peer"; None: all), in table order."""
    return tuple(i for i in BUILTIN if role is None or i.role == role)


__all__ = ["Implementation", "implementation", "load_user_impl", "LoadError", "mask_for", "BUILTIN", "builtin", "select",
           "FRAMEWORKS", "MODES", "MASK_CONVENTIONS", "MASK_SHAPES"]

"""What an implementation is: the `Implementation` declaration, framework-free.

`parity.impls.registry` documents the adapter contract its fields describe and holds the
built-in table; this module holds the declaration alone, so that the table's entries can
live with their libraries (`parity.peers`) and the registry can list those modules without
an import cycle. Everything here is re-exported by `parity.impls`.
"""

from __future__ import annotations

import fnmatch
import importlib
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mha_spec import DTYPE_NAMES, MASK_KINDS, MASKED_ROWS_POLICIES, VARIANT_FEATURES, AttentionConfig, Problem
from parity.contract import to_contract

FRAMEWORKS = ("torch", "jax")
MODES = ("eager", "jit", "compile")
MASK_CONVENTIONS = ("keep", "drop", "additive")
MASK_SHAPES = ("B1TS", "BNTS", "BTS")
ROLES = ("ours", "peer", "user")
INPUTS = ("qkv", "self")


# The harness's structured mask kinds (docs/semantics.md, "Packed sequences, sliding windows and causal
# alignment"): packed documents (segment ids, causal within each), a sliding window and Llama 4's chunked
# attention (kind "chunk") (causal within chunks of C positions). Their home is here, beside RunsOn, which must parse them
# (parity.harness.matrix imports them from here).
STRUCTURED_MASKS = ("packed", "window", "chunk")
# What a `runs_on` pattern's parts name: the attention kind, the mask kind (the harness's cases and
# the benchmark's share `mha_spec.MASK_KINDS`; the harness's cases also `STRUCTURED_MASKS`) and the dtype.
UNIT_INPUTS = ("self", "cross")
UNIT_MASKS = MASK_KINDS + STRUCTURED_MASKS
ANY = "*"
_VOCABULARIES = (("inputs", UNIT_INPUTS), ("mask", UNIT_MASKS), ("dtype", DTYPE_NAMES))


def unit_kind(cross: bool, mask: str, dtype: str) -> str:
    """"<self|cross>/<mask kind>/<dtype>": what `Implementation.runs_on` patterns are written over."""
    return f"{'cross' if cross else 'self'}/{mask}/{dtype}"


@dataclass(frozen=True)
class RunsOn:
    """One unit kind an implementation runs on, parsed from a `runs_on` pattern: each field is a value
    of its vocabulary (UNIT_INPUTS, UNIT_MASKS: mha_spec.MASK_KINDS and STRUCTURED_MASKS, mha_spec.DTYPE_NAMES)
    or "*" (any)."""

    inputs: str = ANY
    mask: str = ANY
    dtype: str = ANY

    def __post_init__(self):
        for (part, allowed), value in zip(_VOCABULARIES, (self.inputs, self.mask, self.dtype)):
            if value != ANY and value not in allowed:
                raise ValueError(f"RunsOn {part} {value!r} is not '*' or one of {allowed}")

    def matches(self, cross: bool, mask: str, dtype: str) -> bool:
        """Whether a unit of this attention kind (cross: query apart from key/value), mask and dtype is one."""
        inputs = "cross" if cross else "self"
        return self.inputs in (ANY, inputs) and self.mask in (ANY, mask) and self.dtype in (ANY, dtype)

    def __str__(self) -> str:
        return f"{self.inputs}/{self.mask}/{self.dtype}"

    @classmethod
    def parse(cls, pattern: str) -> tuple[RunsOn, ...]:
        """The kinds one '<self|cross>/<mask kind>/<dtype>' pattern admits. Each part is "*", a value of
        its vocabulary, or a glob ("float*", "[cp]*") standing for the values it matches, one RunsOn for
        each combination; ValueError naming the part that is none of these."""
        if not isinstance(pattern, str) or pattern.count("/") != 2:
            raise TypeError(f"runs_on pattern {pattern!r} is not '<self|cross>/<mask kind>/<dtype>'")
        choices = []
        for (part, allowed), value in zip(_VOCABULARIES, pattern.split("/")):
            if value == ANY or value in allowed:
                choices.append((value,))
                continue
            globbed = tuple(v for v in allowed if fnmatch.fnmatchcase(v, value))
            if not globbed:
                raise ValueError(f"runs_on pattern {pattern!r}: its {part} {value!r} is not '*' and matches none of {allowed}")
            choices.append(globbed)
        return tuple(cls(*combo) for combo in itertools.product(*choices))


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
    uses_params      fn takes the parameters as its first argument (see the contract in `parity.impls.registry`)
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
                     positions on RoPE cases (see the contract in `parity.impls.registry`)
    classic          whether it also runs the classic layer (no feature used); False for a peer of
                     the variant layers whose classic twin is a peer of its own (keras-gqa, keras-mha)
    runs_on          where it runs, in every check and the benchmark: patterns over a unit's kind
                     "<self|cross>/<mask kind>/<dtype>" (mask kinds: none, padding, causal, random, and the
                     harness's structured packed, window; each
                     part a value, "*" or an fnmatch glob over those values), parsed once into `RunsOn`
                     predicates (`runs_on_rules`); a part naming no value is a ValueError at construction.
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
                     in a float64 model; "bfloat16": a layer that casts to bfloat16 inside): units of a wider
                     dtype are judged at this dtype, its table entry and its yardstick (`judged_at`), in every
                     row (against the oracle, our modules, another layer of yours) and in the stage search, and
                     the row says so; None: the inputs' dtype
    names            a `parity.layouts` layout (e.g. "hf-llama"): `params` (and fn.intermediates') arrive under
                     that layout's names, without prefix (q_proj.weight, o_proj.weight, ...); gradients reach
                     the canonical tensors through the renaming. None: the canonical names
    decode           fn is a decoder, judged by the decode check only: fn(p, x_t, cache, position) ->
                     (out, cache), one token per row x_t (B, 1, E), its own cache (None on the first
                     call), position (B,) int64 the token's RoPE position in its row (-1: a left-padding
                     token no later token may attend); out (B, 1, E). See docs/semantics.md
    structured       fn takes the structured masks (docs/semantics.md, "Packed sequences, sliding windows and
                     causal alignment") as keywords on the cases that have them (mask kinds packed, window):
                     those of is_causal=True, window=(left, right), segment_ids= (B, T), key_segment_ids= (B, S)
                     and alignment="bottom-right" the case uses (segment ids as framework integer arrays: torch
                     int64, JAX int32), and `mask` is then the rest of the case's mask alone (its padding, or
                     None). False: `mask` is the whole mask, dense (`reference.structured_keep` AND the padding)
    takes_chunk      with structured=True: fn also takes chunk=C (Llama 4's chunked attention, the "chunked" cases'
                     keyword). A structured implementation without it skips the chunk cases, saying so (it would
                     be given a keyword it was not written for); one that is not structured gets them dense
    takes_is_causal  fn takes is_causal=True (keyword) with `mask` None in place of a dense causal mask: SDPA's own
                     causal mask, top-left aligned (query t keeps keys 0..t). The benchmark gives it on its causal
                     cases where top-left is the case's causal mask (T = S); elsewhere `mask` is dense, as without it
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
    decode: bool = False
    structured: bool = False
    takes_is_causal: bool = False
    takes_chunk: bool = False
    # `runs_on` parsed (None: everywhere); set by __post_init__, so `dataclasses.replace` re-parses it.
    runs_on_rules: tuple[RunsOn, ...] | None = field(default=None, init=False, repr=False, compare=False)

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
        object.__setattr__(self, "runs_on_rules", self._parse_runs_on())
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

    def _parse_runs_on(self) -> tuple[RunsOn, ...] | None:
        if self.runs_on is None:
            return None
        if not isinstance(self.runs_on, tuple) or not all(isinstance(k, str) and k.count("/") == 2 for k in self.runs_on):
            raise TypeError(f"implementation {self.name!r}: runs_on must be a tuple of '<self|cross>/<mask kind>/<dtype>' "
                            f"patterns (e.g. ('self/causal/*',)), got {self.runs_on!r}")
        try:
            return tuple(rule for pattern in self.runs_on for rule in RunsOn.parse(pattern))
        except ValueError as e:
            raise ValueError(f"implementation {self.name!r}: {e}") from None

    def _check_edges(self) -> None:
        """inputs, computes_in, names: what the layer is called with and computes in."""
        if self.inputs not in INPUTS:
            raise ValueError(f"implementation {self.name!r}: inputs={self.inputs!r} is not one of {INPUTS}")
        if not isinstance(self.structured, bool):
            raise TypeError(f"implementation {self.name!r}: structured must be a bool, got {self.structured!r}")
        if not isinstance(self.takes_is_causal, bool):
            raise TypeError(f"implementation {self.name!r}: takes_is_causal must be a bool, got {self.takes_is_causal!r}")
        if not isinstance(self.takes_chunk, bool):
            raise TypeError(f"implementation {self.name!r}: takes_chunk must be a bool, got {self.takes_chunk!r}")
        if self.takes_chunk and not self.structured:
            raise ValueError(f"implementation {self.name!r}: takes_chunk=True is a structured keyword: it needs "
                             "structured=True (otherwise the chunk arrives in the dense mask)")
        if self.structured and self.decode:
            raise ValueError(f"implementation {self.name!r}: a decoder (decode=True) takes no structured masks "
                             "(with a KV cache the cache's own mask applies)")
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
        if cross is not None and mask is not None and not self.runs_unit(cross, mask, dtype):
            return (f"{self.name} runs only where its runs_on matches the <self|cross>/<mask>/<dtype> of the unit "
                    f"({unit_kind(cross, mask, dtype)}): {', '.join(self.runs_on)}")
        if mask == "chunk" and self.structured and not self.takes_chunk:
            return (f"{self.name} declares structured=True without takes_chunk: it takes the structured masks as "
                    "keywords, and chunk= (Llama 4's chunked attention) is not one it declares")
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
            # every feature the layer uses, declared or not: one outside the declarations is never run unasked
            ordered = (*VARIANT_FEATURES, *sorted(config.features - set(VARIANT_FEATURES)))
            missing = [f for f in ordered if f in config.features and f not in self.variants]
            if missing:
                declared = f"variants={','.join(self.variants)}" if self.variants else "no variants (the classic layer only)"
                return (f"{self.name} declares {declared}: this layer uses {', '.join(missing)}, "
                        f"which it does not run")
        return None

    def judged_at(self, dtype: str) -> str:
        """The dtype whose bound judges a unit of `dtype`: `computes_in` where it is coarser, else `dtype`. The
        harness judges such a unit entirely at that dtype: its table entry and its yardstick (the oracle's maths
        in that dtype, inputs and weights rounded to it), in every row -- against the oracle, our modules, and
        another layer of the user's."""
        if self.computes_in is None:
            return dtype
        from parity.dtypes import coarser

        return coarser(dtype, self.computes_in)

    @property
    def takes_problem(self) -> bool:
        """Whether the factory takes `problem=` and fn the positions: it declares a variant."""
        return bool(self.variants)

    def runs_unit(self, cross: bool, mask: str, dtype: str) -> bool:
        """Whether its `runs_on` admits a unit of this attention kind, mask kind and dtype."""
        return self.runs_on_rules is None or any(r.matches(cross, mask, dtype) for r in self.runs_on_rules)

    def runs(self, kind: str) -> bool:
        """`runs_unit` for a kind spelled "<self|cross>/<mask kind>/<dtype>" ("self/causal/float32", ...)."""
        parts = kind.split("/") if isinstance(kind, str) else []
        if len(parts) != 3 or parts[0] not in UNIT_INPUTS:
            raise ValueError(f"unit kind {kind!r} is not '<self|cross>/<mask kind>/<dtype>'")
        return self.runs_unit(parts[0] == "cross", parts[1], parts[2])

    @property
    def materializes_scores(self) -> bool:
        return self.returns_weights if self.materializes is None else self.materializes

    @property
    def bench_fields(self) -> tuple[str, str, str]:
        """(family, mode, "weights" | "fused"): the parts of `bench_key`, for matching without re-parsing it."""
        return self.family or self.name, self.mode, "weights" if self.returns_weights else "fused"

    @property
    def bench_key(self) -> str:
        """The benchmark's row key: family:mode:weights|fused (the JSON and command-line spelling)."""
        return ":".join(self.bench_fields)

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
            fn = to_contract(self, fn, num_heads=num_heads)
        return fn

    def resolve_factory(self) -> Callable:
        if callable(self.factory):
            return self.factory
        obj = import_attr(self.factory)
        if not callable(obj):
            raise TypeError(f"implementation {self.name!r}: {self.factory} is not callable")
        return obj


class LoadError(ValueError):
    """A user implementation ('module:attribute') could not be loaded; the message is one line
    naming the module and what went wrong. Both command-line tools make it a usage error (exit 2)."""


def import_attr(spec: str):
    """'module:attribute' -> the object; a `LoadError` naming the module for any failure to load it."""
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

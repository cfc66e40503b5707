"""Planted bugs for the harness's own tests: adapters that wrap one of ours and break one thing.

Each is an ordinary `Implementation` (role "user"), so a planted bug travels the same road
as a researcher's own layer: built from the canonical weights, judged by the oracle, and
localised to a stage through the wrapped module's intermediates.
"""

from __future__ import annotations

import contextlib
import functools

from parity.impls import Implementation, builtin


def _wrap(base_name: str, name: str, around):
    """An Implementation running `base_name`'s fn and intermediates through `around(fn) -> fn`."""
    base = builtin(base_name)

    def factory(sd, num_heads, **kw):
        kw.setdefault("masked_rows", "uniform")  # the planted adapters follow the test case's policy
        fn = base.resolve_factory()(sd, num_heads, **kw)
        wrapped = around(fn)
        wrapped.intermediates = around(fn.intermediates)
        return wrapped

    return Implementation(name, base.framework, factory, base.mode, base.returns_weights, masked_rows="uniform",
                          role="user")


def _transpose_q(fn):
    @functools.wraps(fn)
    def call(params, *args):
        return fn({**params, "q_proj.weight": params["q_proj.weight"].T}, *args)

    return call


def _flip_mask(fn):
    @functools.wraps(fn)
    def call(params, q, k, v, keep):
        return fn(params, q, k, v, None if keep is None else ~keep)

    return call


@contextlib.contextmanager
def _doubled_q_in_core(module):
    """Swap the attention cores for ones that see 2·q: the scores are scaled by 2/√H."""
    saved = {n: getattr(module, n) for n in ("attention_core", "fused_attention_core")}
    for n, real in saved.items():
        setattr(module, n, lambda q, k, v, keep=None, _real=real, **kw: _real(q * 2, k, v, keep, **kw))
    try:
        yield
    finally:
        for n, real in saved.items():
            setattr(module, n, real)


def _wrong_scale(module):
    def around(fn):
        @functools.wraps(fn)
        def call(*args):
            with _doubled_q_in_core(module):
                return fn(*args)

        return call

    return around


def transposed_q_weight(framework="jax"):
    return _wrap("jax-jit" if framework == "jax" else "torch", f"{framework}-transposed-q", _transpose_q)


def flipped_mask(framework="jax"):
    return _wrap("jax-jit" if framework == "jax" else "torch", f"{framework}-flipped-mask", _flip_mask)


def wrong_scale(base_name="torch"):
    import importlib

    module = importlib.import_module("mha_torch.attention" if base_name.startswith("torch") else "mha_jax.attention")
    return _wrap(base_name, f"{base_name}-wrong-scale", _wrong_scale(module))

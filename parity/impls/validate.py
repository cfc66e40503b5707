"""What an implementation returned, checked before anything is judged: a user's bug is a clear error."""

from __future__ import annotations


class ImplementationError(ValueError):
    """An implementation returned something the contract does not allow (names it and what was wrong)."""


def check_result(impl, result, array_type, q_shape, S: int, num_heads: int, dtype):
    """(output, weights or None) from fn's result, or ImplementationError naming `impl` and the problem."""
    B, T, E = q_shape
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise ImplementationError(f"{impl.name} returned a {type(result).__name__} of {len(result)} items; "
                                      "expected output or (output, weights)")
        out, w = result
    else:
        out, w = result, None
    _check_array(impl, "output", out, array_type, (B, T, E), dtype)
    if impl.returns_weights:
        if w is None:
            raise ImplementationError(f"{impl.name} declares returns_weights=True but returned no weights")
        _check_array(impl, "weights", w, array_type, (B, num_heads, T, S), dtype)
    else:
        w = None  # declared without weights: whatever came second is not judged
    return out, w


def _check_array(impl, what: str, x, array_type, shape, dtype) -> None:
    if not isinstance(x, array_type):
        raise ImplementationError(f"{impl.name} returned {what} of type {type(x).__name__}, "
                                  f"expected a {impl.framework} array")
    if tuple(x.shape) != tuple(shape):
        raise ImplementationError(f"{impl.name} returned {what} of shape {tuple(x.shape)}, expected {tuple(shape)}")
    got = str(x.dtype).removeprefix("torch.")
    if got != str(dtype):
        raise ImplementationError(f"{impl.name} returned {what} of dtype {got}, expected {dtype} (the inputs' dtype)")


def stages_dict(impl, got) -> dict:
    """fn.intermediates' result as {stage: array}: a mapping, or a dataclass such as mha_spec.Stages."""
    import dataclasses
    from collections.abc import Mapping

    if dataclasses.is_dataclass(got) and not isinstance(got, type):
        got = {f.name: getattr(got, f.name) for f in dataclasses.fields(got)}
    if not isinstance(got, Mapping):
        raise ImplementationError(f"{impl.name}: intermediates returned {type(got).__name__}, expected a dict of stages")
    return {k: v for k, v in got.items() if v is not None}


def check_decoder_signature(impl, fn) -> None:
    """ImplementationError unless fn can be called as the decode protocol calls it:
    fn(p, x_t, cache, position), or fn(x_t, cache, position) with uses_params=False."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension object: its first call says
        return
    args = (None, None, None, None) if impl.uses_params else (None, None, None)
    try:
        sig.bind(*args)
    except TypeError as e:
        call = "fn(p, x_t, cache, position)" if impl.uses_params else "fn(x_t, cache, position) (uses_params=False)"
        raise ImplementationError(f"{impl.name} declares decode=True: it is called {call} -> (out, cache), "
                                  f"but its fn{sig} cannot be ({e})") from None


def check_step(impl, result, array_type, B: int, E: int, dtype):
    """(out, cache) from a decoder's result, out (B, 1, E) of the framework in the inputs' dtype;
    ImplementationError naming `impl` and the problem otherwise."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        what = f"a {type(result).__name__} of {len(result)} items" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ImplementationError(f"{impl.name} (a decoder) returned {what}; expected (out, cache)")
    out, cache = result
    _check_array(impl, "output", out, array_type, (B, 1, E), dtype)
    return out, cache

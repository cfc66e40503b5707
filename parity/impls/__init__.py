"""One registry of attention implementations, shared by `mha-parity` and `mha-bench`.

    registry      the `Implementation` declaration (framework-free), the built-in table,
                  `implementation(...)` for a user's own factory, `load_user_impl("mod:attr")`
    torch_impls   the torch factories and how torch runs any implementation (imports torch only)
    jax_impls     the JAX factories and how JAX runs any implementation (imports jax only)
"""

from parity.impls.registry import (
    BUILTIN,
    Implementation,
    LoadError,
    builtin,
    implementation,
    load_user_impl,
    mask_for,
    select,
)

__all__ = ["Implementation", "LoadError", "implementation", "load_user_impl", "mask_for", "BUILTIN", "builtin", "select"]

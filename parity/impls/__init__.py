"""One registry of attention implementations, shared by `mha-parity` and `mha-bench`.

    registry      the adapter contract, the built-in table (ours, and one line per peer module of
                  parity.peers), `implementation(...)` for a user's own factory, `load_user_impl("mod:attr")`
    torch_impls   our torch module's factories and how torch runs any implementation (imports torch only)
    jax_impls     our JAX module's factories and how JAX runs any implementation (imports jax only)

`Implementation`, the declaration itself (framework-free), is defined in `parity.implementation`
so that each peer module can declare its own without importing the registry.
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

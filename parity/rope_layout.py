"""The q/k row order of the two RoPE conventions, and the permutation between them.

Meta's checkpoints rotate interleaved pairs of a head's dims, Hugging Face's the two halves
(`rope="interleaved"` and `rope="half"` of our modules); `permute_rope` reorders a canonical
state dict's q/k rows from one to the other. NumPy only, so both the converters
(`parity.convert` re-exports it) and the peers (`parity.peers.hf`) build on it.
"""

from __future__ import annotations

import numpy as np

ROPE_TARGETS = ("half", "interleaved")


def permute_rope(sd, *, num_heads: int, num_kv_heads: int | None = None, to: str) -> dict[str, np.ndarray]:
    """Reorder the q/k projection rows between the two RoPE conventions; other entries unchanged.

    to="half" is Hugging Face's convert_llama_weights_to_hf permutation of Meta's rows
    (`w.view(n, rows // n // 2, 2, cols).transpose(1, 2).reshape(rows, cols)`), so weights
    run with rope="interleaved" give the same output as the permuted ones with rope="half";
    to="interleaved" is its exact inverse. q rows use num_heads, k rows num_kv_heads; q/k
    biases, when present, are reordered with their rows.

    num_kv_heads=None means num_heads, right only for a layer with as many key/value heads as
    query heads; a grouped checkpoint (Llama 2 70B, Llama 3: fewer key/value heads) needs its
    K, `n_kv_heads` in Meta's params.json (`num_key_value_heads` in a config.json). The head
    dim H comes from q: q_proj.weight must have num_heads * H rows with H even, k_proj's rows
    must be the key/value heads * H, else a ValueError names the tensor, its shape and the
    heads (a wrong head count would permute the rows within the wrong blocks, silently).
    """
    if to not in ROPE_TARGETS:
        raise ValueError(f"to={to!r} is not one of {ROPE_TARGETS}")
    kv = num_heads if num_kv_heads is None else num_kv_heads
    for name, val in (("num_heads", num_heads), ("num_kv_heads", kv)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    H = _rope_head_dim(sd, num_heads)
    out = dict(sd)
    for proj, heads in (("q_proj", num_heads), ("k_proj", kv)):
        for suffix in ("weight", "bias"):
            key = f"{proj}.{suffix}"
            if key not in sd:
                continue
            w = np.asarray(sd[key])
            _check_rope_rows(key, w.shape, heads, H, num_heads, num_kv_heads)
            x = w.reshape((heads, H // 2, 2) + w.shape[1:]) if to == "half" \
                else w.reshape((heads, 2, H // 2) + w.shape[1:])
            out[key] = np.ascontiguousarray(np.swapaxes(x, 1, 2).reshape(w.shape))
    return out


def _rope_head_dim(sd, num_heads: int) -> int:
    """H from q_proj.weight's (num_heads * H, E) rows, H even; a ValueError naming the shape otherwise."""
    if "q_proj.weight" not in sd:
        raise ValueError(f"permute_rope needs q_proj.weight (its rows give the head dim); got keys {sorted(sd)}")
    shape = np.shape(sd["q_proj.weight"])
    if len(shape) != 2 or shape[0] % num_heads or (shape[0] // num_heads) % 2:
        raise ValueError(f"q_proj.weight has {shape[0] if shape else 0} rows, not {num_heads} heads of an even "
                         f"head_dim (shape {shape}, num_heads={num_heads})")
    return shape[0] // num_heads


def _check_rope_rows(key: str, shape: tuple, heads: int, H: int, num_heads: int, num_kv_heads) -> None:
    """key's rows must be heads * H (a weight 2-D, a bias 1-D); the ValueError names the heads used."""
    ndim = 2 if key.endswith(".weight") else 1
    if len(shape) == ndim and shape[0] == heads * H:
        return
    if key.startswith("q_proj"):
        expected = f"({heads * H}, E)" if ndim == 2 else f"({heads * H},)"
        raise ValueError(f"{key} has shape {shape}, expected {expected}: num_heads={num_heads} heads of "
                         f"head_dim {H} (from q_proj.weight)")
    given = f"num_kv_heads={num_kv_heads}" if num_kv_heads is not None else \
        f"num_kv_heads=None means num_heads={num_heads}"
    hint = ""
    if len(shape) == ndim and shape[0] % H == 0:
        where = "for a grouped checkpoint " if num_kv_heads is None else ""
        hint = (f"; its {shape[0]} rows are {shape[0] // H} heads: {where}pass num_kv_heads={shape[0] // H} "
                f"(n_kv_heads in Meta's params.json, num_key_value_heads in config.json)")
    raise ValueError(f"{key} has shape {shape}, but {given} key/value heads of head_dim {H} "
                     f"(from q_proj.weight) need {heads * H} rows{hint}")

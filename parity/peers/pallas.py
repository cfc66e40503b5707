"""The Pallas attention kernels shipped with jax as peers: our projections around each kernel.

    pallas-gpu-flash    jax.experimental.pallas.ops.gpu.attention.mha (Triton flash attention), forward and
                        its own Pallas backward (mha's custom_vjp, backward_pass_impl="triton")
    pallas-tpu-flash    jax.experimental.pallas.ops.tpu.flash_attention (Mosaic), forward and its own Pallas
                        backward (dkv and dq kernels)
    pallas-gpu-decode   jax.experimental.pallas.ops.gpu.decode_attention.gqa, single-query decode over a
                        KV cache, as a decoder (decode=True) of the decode protocol

    factory(state_dict, num_heads, *, dtype, device, problem) -> fn
    fn(params, query, key, value, keep[, *, positions=None, key_positions=None, is_causal=False,
       segment_ids=None]) -> output                                        (the two flash peers)
    fn(params, x_t, cache, position) -> (output, cache)                     (the decoder)

Where they run, by the platform of the device they are built for (`jax.default_backend()` when
none is given): on CPU every kernel runs in Pallas interpret mode -- the GPU kernels with
`interpret=True`, the TPU kernel under `pltpu.force_tpu_interpret_mode()` (flash_attention has no
interpret argument) -- the same kernel bodies, block specs and grids, executed by XLA on the CPU;
on a GPU the GPU kernels run natively (Triton) and the TPU kernel is a skip; on a TPU the TPU
kernel runs natively and the GPU kernels are skips. Native runs have not been measured here (no
accelerator): the interpret-mode numbers below are the ones this module's claims rest on.

Masks. The flash kernels take `causal` (top-left: query t keeps keys s <= t) and segment ids (keys
of the query's own id) only, so a keep-mask runs when it IS one of these: all True, causal, equal
segment ids, or causal AND equal segment ids (a packed row, causal within each document).
`kernel_mask` reads the dense keep-mask the harness passes (B|1, 1, T, T) as such (the first kept
key of each row names its segment); any other mask -- key padding, a random mask, a window, a
fully masked row -- and T != S are `KernelCannot`, which the harness makes a skip row naming the
reason (it is a `MissingPackage`, the harness's one "not run" exception). Called directly, `fn`
also takes is_causal= and segment_ids= (B, T) in place of `keep` (then segment ids may be traced).
A fully masked row never reaches a kernel (causal and segment masks in T = S keep each query's own
key; a mask with one is `KernelCannot`), so the declared masked_rows="uniform" is never exercised.

Blocks and padding (the kernels need lengths that are multiples of their blocks):
    gpu flash    blocks of 16 (forward block_q = block_k, backward block_q_dkv = block_kv_dkv =
                 block_q_dq = block_kv_dq: Triton's smallest dot tile); T padded with zero tokens
                 to a multiple of 16 and the head dim with zero features to a power of two >= 16 (exact:
                 a zero feature adds nothing to q.k, a zero value column is sliced off)
    tpu flash    blocks of 128 (its kernels tile the key block and the softmax statistics by 128 lanes:
                 segment ids and the backward need block_k % 128 == 0); T padded to a multiple of 128
    gpu decode   block_k = 16, k_splits = 1, block_h = 16; the cache grows in slots of 16 (one compile
                 per capacity), head dim padded as for gpu flash
The padded keys are kept out of every real query's row: by `causal` alone when the mask is causal
(they come after every real token), else by a segment id of their own; the padded queries' rows
are sliced off (their cotangent is zero, so they add nothing to the gradients).

Grouped heads: the decode kernel reads K key/value heads natively (`gqa`: N/K query heads per
key/value head); the flash kernels take N heads for q, k and v alike, so K heads are repeated
N/K times before them (their gradients sum back through the repeat). RoPE is `jax_dpa.rope`
(complex pairs), applied to q and k before the kernel; the decoder rotates each token at its
position and caches the rotated key. dtypes: float32 only (the kernels compute in float32: float64
inputs would be cast down; 16-bit inputs were not measured).

The kernels run with jax_enable_x64 off (the GPU kernels' block arithmetic mixes int32 program
ids with int64 constants under x64 and fails to trace): each kernel call, forward and backward,
is wrapped (`contained`) so that both run in that context, whatever the caller's.

Measured (Intel(R) Xeon(R) Processor, 2 cores shared with other work, `lscpu`; jax 0.10.2; float32), at
tests/test_peer_pallas.py's sizes B=2, T=S=13, E=32, N=4 heads, K=2 key/value heads, H=8, against the
float64 oracle on the same float32-rounded weights and inputs (max |error|; jax.nn.dot_product_attention
with XLA on the same projections: 2.0e-6 forward, 1.5e-5 gradients), causal, packed and no mask:
    pallas-gpu-flash    interpret: output 2.2e-6, gradients 2.1e-5; a first call (compile included)
                        0.4-1.1 s forward, 1.0-1.9 s forward + backward; again at the same shapes 0.006 s
    pallas-tpu-flash    interpret: output 1.6e-6, gradients 1.6e-5; a first call 1.0-1.2 s forward, 2.9 s
                        forward + backward (T padded to 128); again 0.08-0.2 s (it simulates TPU memory)
    pallas-gpu-decode   interpret: output 1.7e-6 over 7 tokens fed one per call (3 rows left-padded by 0, 2,
                        1; grouped, RoPE); 2.4 s for the 7 calls with the compile, 0.04 s for 7 more
In the harness the flash peers run the packed units only (`runs_on`, what is worth the time) and the
decoder the float32 decode cases: `run(checks=("peers", "decode"), dtypes=("float32",))` on the default
matrix took 17.5 s without these three and 27.0 s with them (the packed-llama unit, forward and
gradients, for each flash peer; the decode-llama case for the decoder).
Legend (see mha_spec): B T S N K H E.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import numpy as np

from mha_spec import LLAMA_FEATURES
from parity.implementation import Implementation
from parity.peers.common import MissingPackage, jax_out, jax_project
from parity.peers.jax_dpa import rope

# What no other file of parity/ uses (tests/test_house.py): the Pallas package and its kernels.
OWNS = ("import jax.experimental.pallas",)

GPU_BLOCK = 16  # gpu flash: every forward and backward block; also the decode kernel's block_k and cache slot
TPU_BLOCK = 128  # tpu flash: every block (its lane width, NUM_LANES / MIN_BLOCK_SIZE)
GPU_MIN_HEAD = 16  # the head dim the GPU kernels' dots need at least (padded with zeros up to a power of two)
PLATFORMS = {"pallas-gpu-flash": "gpu", "pallas-tpu-flash": "tpu", "pallas-gpu-decode": "gpu"}


class KernelCannot(MissingPackage):
    """A problem the kernel cannot express (a mask that is not causal/segment ids, T != S, a platform it does
    not run on). A `MissingPackage` because that is what the harness turns into a skip row ("<name> not run:
    <reason>"); nothing is missing: the reason names what the kernel lacks."""


# ---------------------------------------------------------------- where and how a kernel runs


def platform_of(device) -> str:
    """The platform a peer built for `device` runs on: its own, else `jax.default_backend()`."""
    import jax

    return getattr(device, "platform", None) or jax.default_backend()


def interpreted(name: str, platform: str) -> bool:
    """Whether peer `name` runs in Pallas interpret mode on `platform` (True on CPU, False natively on its
    own accelerator); `KernelCannot` on the other accelerator."""
    own = PLATFORMS[name]
    if platform == "cpu":
        return True
    if platform == own:
        return False
    lowering = "Triton" if own == "gpu" else "Mosaic"
    raise KernelCannot(f"{name} is a {own.upper()} kernel ({lowering}): it does not run natively on {platform}, "
                       f"and interpret mode is for CPU runs")


def contained(kernel, tpu_interpret: bool):
    """kernel(q, k, v, seg) with jax_enable_x64 off (and TPU interpret mode when asked) for its forward AND its
    backward: a custom_vjp whose forward takes the kernel's own vjp inside that context and whose backward
    applies it there, so the kernel's backward is traced there too (it is traced when the cotangent arrives,
    outside any `with` around the forward)."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    @contextlib.contextmanager
    def context():
        with jax.enable_x64(False):
            if tpu_interpret:
                with pltpu.force_tpu_interpret_mode():
                    yield
            else:
                yield

    @jax.custom_vjp
    def call(q, k, v, seg):
        with context():
            return kernel(q, k, v, seg)

    def fwd(q, k, v, seg):
        with context():
            out, pull = jax.vjp(lambda q, k, v: kernel(q, k, v, seg), q, k, v)
        return out, pull

    def bwd(pull, g):
        with context():
            return (*pull(g), None)  # segment ids: integers, no cotangent

    call.defvjp(fwd, bwd)
    return call


# ---------------------------------------------------------------- masks


def kernel_mask(keep) -> tuple[bool, np.ndarray | None]:
    """A dense keep-mask bool (B|1, 1, T, T) -> (causal, segment_ids int32 (B|1, T) or None) with
    keep[b, 0, t, s] == (s <= t if causal) & (segment_ids[b, t] == segment_ids[b, s]) everywhere;
    `KernelCannot` when there is none. A row's first kept key names its segment (the first token of
    its document), so equal ids are exactly the rows a document's tokens keep."""
    import jax

    if isinstance(keep, jax.core.Tracer):
        raise TypeError("a traced keep-mask cannot be read as causal / segment ids: call the peer outside jax.jit, "
                        "or pass is_causal= and segment_ids= instead of the mask")
    keep = np.asarray(keep)
    if keep.dtype != np.bool_ or keep.ndim != 4 or keep.shape[1] != 1:
        raise ValueError(f"keep must be a bool (B, 1, T, S) mask, got {keep.dtype} {keep.shape}")
    _, _, T, S = keep.shape
    if T != S:
        raise KernelCannot(f"a mask over T={T} queries and S={S} keys: the kernels take one segment-id row for "
                           "queries and keys (T = S)")
    rows = keep[:, 0]  # (B, T, T)
    if not rows.any(axis=-1).all():
        raise KernelCannot("a fully masked row: causal and segment-id masks keep each query's own key")
    first = rows.argmax(axis=-1)  # (B, T): each row's first kept key
    same = first[:, :, None] == first[:, None, :]  # (B, T, T)
    for causal in (False, True):
        if np.array_equal(same & np.tri(T, dtype=bool) if causal else same, rows):
            one_segment = bool((first == first[:, :1]).all())
            return causal, None if one_segment else first.astype(np.int32)
    raise KernelCannot("the mask is not causal, segment ids, or both (key padding, a random mask and a window are "
                       "not what these kernels take)")


def _mask_args(name, keep, is_causal, segment_ids, B: int, T: int, S: int):
    """(causal, segment ids (B, T) int32 or None) from either the dense mask or the keywords."""
    import jax.numpy as jnp

    if T != S:
        raise KernelCannot(f"{name} runs T = S only (one segment-id row for queries and keys, and the fused backward "
                           f"needs as many query as key blocks): got T={T}, S={S}")
    if keep is not None:
        if is_causal or segment_ids is not None:
            raise ValueError(f"{name}: pass the mask as keep= or as is_causal=/segment_ids=, not both")
        causal, seg = kernel_mask(keep)
    else:
        causal, seg = bool(is_causal), segment_ids
    if seg is not None:
        seg = jnp.broadcast_to(jnp.asarray(seg, jnp.int32), (B, T))
    return causal, seg


def padded_segments(causal: bool, seg, B: int, T: int, padded: int):
    """The segment ids of T tokens padded to `padded`: the pads get an id no real token has, so no real
    query keeps them; None where causal alone keeps them out (pads come after every real token)."""
    import jax.numpy as jnp

    if padded == T or (causal and seg is None):
        return seg
    base = jnp.zeros((B, T), jnp.int32) if seg is None else seg
    return jnp.concatenate([base, jnp.full((B, padded - T), jnp.max(base) + 1, jnp.int32)], axis=1)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def gpu_head_dim(H: int) -> int:
    """The head dim the GPU kernels run: a power of two, at least GPU_MIN_HEAD."""
    return max(GPU_MIN_HEAD, 1 << (H - 1).bit_length())


# ---------------------------------------------------------------- kernels (q, k, v: (B, T, N, H))


@functools.lru_cache(maxsize=None)
def _gpu_flash(causal: bool, sm_scale: float, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention

    b = GPU_BLOCK
    blocks = attention.BlockSizes(block_q=b, block_k=b, block_q_dkv=b, block_kv_dkv=b, block_q_dq=b, block_kv_dq=b)

    def kernel(q, k, v, seg):
        return attention.mha(q, k, v, seg, sm_scale=sm_scale, causal=causal, block_sizes=blocks,
                             backward_pass_impl="triton", interpret=interpret)

    return contained(kernel, tpu_interpret=False)


def gpu_flash_core(q, k, v, *, causal: bool, segment_ids, sm_scale: float, interpret: bool):
    """q, k, v (B, T, N, H) -> context (B, T, N, H) by the GPU flash kernel, padded as the module docstring says."""
    import jax.numpy as jnp

    B, T, N, H = q.shape
    Tp, Hp = _round_up(T, GPU_BLOCK), gpu_head_dim(H)
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, Hp - H))
    seg = padded_segments(causal, segment_ids, B, T, Tp)
    out = _gpu_flash(causal, sm_scale, interpret)(*(jnp.pad(x, pad) for x in (q, k, v)), seg)
    return out[:, :T, :, :H]


@functools.lru_cache(maxsize=None)
def _tpu_flash(causal: bool, sm_scale: float, interpret: bool):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b = TPU_BLOCK
    blocks = fa.BlockSizes(block_q=b, block_k_major=b, block_k=b, block_b=1, block_q_major_dkv=b, block_k_major_dkv=b,
                           block_k_dkv=b, block_q_dkv=b, block_k_major_dq=b, block_k_dq=b, block_q_dq=b)

    def kernel(q, k, v, seg):  # (B, N, T, H)
        ids = None if seg is None else fa.SegmentIds(q=seg, kv=seg)
        return fa.flash_attention(q, k, v, segment_ids=ids, causal=causal, sm_scale=sm_scale, block_sizes=blocks)

    return contained(kernel, tpu_interpret=interpret)


def tpu_flash_core(q, k, v, *, causal: bool, segment_ids, sm_scale: float, interpret: bool):
    """q, k, v (B, T, N, H) -> context (B, T, N, H) by the TPU flash kernel, T padded to a multiple of TPU_BLOCK."""
    import jax.numpy as jnp

    B, T, N, H = q.shape
    Tp = _round_up(T, TPU_BLOCK)
    pad = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
    seg = padded_segments(causal, segment_ids, B, T, Tp)
    out = _tpu_flash(causal, sm_scale, interpret)(*(jnp.pad(x.transpose(0, 2, 1, 3), pad) for x in (q, k, v)), seg)
    return out[:, :, :T].transpose(0, 2, 1, 3)


# ---------------------------------------------------------------- factories (parity.impls.registry's contract)


def _flash_peer(name: str, core, num_heads: int, device, problem):
    import jax.numpy as jnp

    cfg = problem.config
    N, K, H = cfg.num_heads, cfg.kv_heads, cfg.head_size
    if N != num_heads:
        raise ValueError(f"{name}: num_heads={num_heads} but the problem's config has {N}")
    interpret = interpreted(name, platform_of(device))

    def fn(params, query, key, value, keep, *, positions=None, key_positions=None, is_causal=False, segment_ids=None):
        B, T, _ = query.shape
        S = key.shape[1]
        causal, seg = _mask_args(name, keep, is_causal, segment_ids, B, T, S)  # before any compile: a skip is cheap
        q = jax_project(query, params, "q_proj", N, H)  # (B, T, N, H)
        k, v = jax_project(key, params, "k_proj", K, H), jax_project(value, params, "v_proj", K, H)  # (B, S, K, H)
        if cfg.rope is not None:
            q, k = rope(q, positions, cfg.rope_theta, cfg.rope), rope(k, key_positions, cfg.rope_theta, cfg.rope)
        if K != N:  # query head h reads key/value head h // (N / K)
            k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
        ctx = core(q, k, v, causal=causal, segment_ids=seg, sm_scale=1.0 / math.sqrt(H), interpret=interpret)
        return jax_out(ctx.reshape(B, T, N * H), params)

    return fn


def gpu_flash(sd, num_heads, *, dtype, device, problem):
    return _flash_peer("pallas-gpu-flash", gpu_flash_core, num_heads, device, problem)


def tpu_flash(sd, num_heads, *, dtype, device, problem):
    return _flash_peer("pallas-tpu-flash", tpu_flash_core, num_heads, device, problem)


@dataclass(frozen=True)
class DecodeCache:
    """The decoder's cache: `length` slots filled in every row (one token a row per call), of `capacity`."""

    k: object  # (B, capacity, K, Hp) keys after RoPE, zero beyond `length`
    v: object  # (B, capacity, K, Hp)
    length: int
    start: np.ndarray  # (B,) int32: each row's left-padding tokens, the slots before its first real token

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def decode_step(params, x_t, cache: DecodeCache | None, position, *, config, interpret: bool, start_shift: int = 0):
    """One token per row through the decode kernel: x_t (B, 1, E), position (B,) (-1: left padding) ->
    (output (B, 1, E), the cache with the token appended). The kernel attends slots [start, length) of a row,
    one contiguous run: left padding must come before a row's first real token (a ValueError otherwise).
    start_shift moves every row's first attended slot (0: the decoder; tests plant a bug with it)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import decode_attention

    if isinstance(position, jax.core.Tracer):
        raise TypeError("pallas-gpu-decode reads its positions (which tokens are left padding): call it outside jax.jit")
    N, K, H = config.num_heads, config.kv_heads, config.head_size
    Hp = gpu_head_dim(H)
    B = x_t.shape[0]
    pos = np.asarray(position)
    pad = pos < 0
    if cache is None:
        start = pad.astype(np.int32)
        k_all = v_all = jnp.zeros((B, GPU_BLOCK, K, Hp), x_t.dtype)
        length = 0
    else:
        if not isinstance(cache, DecodeCache):
            raise TypeError(f"cache must be None or the DecodeCache this decoder returned, got {type(cache).__name__}")
        late = pad & (cache.start < cache.length)
        if late.any():
            raise ValueError(f"pallas-gpu-decode: rows {np.flatnonzero(late).tolist()} get a padding token after a real "
                             "one; the kernel attends one contiguous run of slots per row")
        start = cache.start + (pad & (cache.start == cache.length)).astype(np.int32)
        k_all, v_all, length = cache.k, cache.v, cache.length
        if length == cache.capacity:  # full: GPU_BLOCK more slots (a new kernel shape)
            grow = jnp.zeros((B, GPU_BLOCK, K, Hp), x_t.dtype)
            k_all, v_all = jnp.concatenate([k_all, grow], axis=1), jnp.concatenate([v_all, grow], axis=1)
    q = jax_project(x_t, params, "q_proj", N, H)  # (B, 1, N, H)
    k = jax_project(x_t, params, "k_proj", K, H)  # (B, 1, K, H)
    v = jax_project(x_t, params, "v_proj", K, H)
    if config.rope is not None:
        at = jnp.asarray(np.where(pad, 0, pos)[:, None])  # (B, 1): a padding token's position is never seen
        q, k = rope(q, at, config.rope_theta, config.rope), rope(k, at, config.rope_theta, config.rope)
    widen = ((0, 0), (0, 0), (0, Hp - H))
    k_all = k_all.at[:, length].set(jnp.pad(k[:, 0], widen))
    v_all = v_all.at[:, length].set(jnp.pad(v[:, 0], widen))
    first = np.minimum(start + start_shift, length + 1).astype(np.int32)
    with jax.enable_x64(False):
        ctx = decode_attention.gqa(jnp.pad(q[:, 0], widen), k_all, v_all, start_idx=jnp.asarray(first),
                                   kv_seq_len=jnp.full((B,), length + 1, jnp.int32), sm_scale=1.0 / math.sqrt(H),
                                   block_h=GPU_BLOCK, block_k=GPU_BLOCK, k_splits=1, interpret=interpret)  # (B, N, Hp)
    out = jax_out(ctx[:, :, :H].reshape(B, 1, N * H), params)
    return out, DecodeCache(k_all, v_all, length + 1, start)


def gpu_decode(sd, num_heads, *, dtype, device, problem):
    config = problem.config
    if config.num_heads != num_heads:
        raise ValueError(f"pallas-gpu-decode: num_heads={num_heads} but the problem's config has {config.num_heads}")
    interpret = interpreted("pallas-gpu-decode", platform_of(device))

    def fn(p, x_t, cache, position):
        return decode_step(p, x_t, cache, position, config=config, interpret=interpret)

    return fn


# ---------------------------------------------------------------- declarations

_ONLY = ("float32",)
# What is worth the time (each unit is seconds of interpret mode on a CPU, forward and gradients): the packed
# self-attention units, causal AND segment ids, both of the kernels' masks at once (T = S: see `_mask_args`).
# The causal and unmasked units ask less of them; tests/test_peer_pallas.py runs those directly.
_PACKED = ("self/packed/*",)
_WHERE = "on CPU in Pallas interpret mode (interpret), natively on its own accelerator"

IMPLEMENTATIONS = (
    Implementation("pallas-gpu-flash", "jax", f"{__name__}:gpu_flash", "eager", False, masked_rows="uniform",
                   role="peer", bench=False, materializes=False, dtypes=_ONLY, runs_on=_PACKED, variants=LLAMA_FEATURES,
                   doc=f"Pallas GPU flash attention (Triton mha, its own backward) {_WHERE}; causal and segment-id "
                   "masks only (others: skip), T padded to blocks of 16, K heads repeated to N"),
    Implementation("pallas-tpu-flash", "jax", f"{__name__}:tpu_flash", "eager", False, masked_rows="uniform",
                   role="peer", bench=False, materializes=False, dtypes=_ONLY, runs_on=_PACKED, variants=LLAMA_FEATURES,
                   doc=f"Pallas TPU flash attention (Mosaic flash_attention, its own backward) {_WHERE}; causal and "
                   "segment-id masks only (others: skip), T padded to blocks of 128, K heads repeated to N"),
    Implementation("pallas-gpu-decode", "jax", f"{__name__}:gpu_decode", "eager", False, masked_rows="zero",
                   role="peer", bench=False, materializes=False, dtypes=_ONLY, variants=LLAMA_FEATURES, decode=True,
                   doc=f"Pallas GPU decode attention (gqa: K heads native) {_WHERE}; one query a call over a cache "
                   "growing in slots of 16, the left padding as start_idx"),
)

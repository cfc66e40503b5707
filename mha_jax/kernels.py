"""Which kernel the JAX fused path (need_weights=False) runs, and with which chunk sizes.

Kernels (the names the benchmark records):

  einsum     `attention_core` without returning the weights: materialises (B, N, T, S)
  chunked    `chunked_attention`: online softmax, flash backward, O(T + S) memory
  dpa-xla    `jax.nn.dot_product_attention(implementation="xla")`: materialises
  dpa-cudnn  `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN flash attention
  pallas-gpu-flash  jax's Pallas (Triton) flash kernel `jax.experimental.pallas.ops.gpu.attention.mha`
  pallas-tpu-flash  jax's Pallas (Mosaic) flash kernel `jax.experimental.pallas.ops.tpu.flash_attention`

Other modules name them by the constants EINSUM, CHUNKED, DPA_XLA, DPA_CUDNN, PALLAS_GPU and
PALLAS_TPU, and show a choice as `kernel_label` spells it ("chunked:256x512" with the blocks;
`parse_label` reads it back). KERNELS are the four a measured row may name (`mha_jax.tune`
times them); the two Pallas kernels are chosen by rule only, and ALL_KERNELS holds all six.

Measured rows are keyed by processor (`Processor`: device kind, model, vector ISA), since
one device kind ("cpu") covers machines whose best blocks differ. `fused_choice` reads,
in order, and the first that has rows for this processor wins:

1. the user's table, written by `python -m mha_jax.tune` (`mha_jax.cache.kernel_table_path()`);
   a corrupt or unreadable file is ignored with a UserWarning;
2. the built-in rows for this processor (`BUILTIN`);
3. the built-in and user rows of every other processor of the same device kind.

Within those rows the nearest measured problem (in log B·N, log T, log S) gives the kernel
and the chunked kernel's blocks and head chunk (how many of its B·K head blocks run a step:
fewer keep a taller block's scores in cache); `Choice.why` says which source and row. Rules that come
before any row, each for a reason that no timing can overrule:

- float64 never runs dpa-* (their softmax is float32: 4e-8 off the float64 oracle);
- float16 never runs dpa-xla (it takes no precision argument, and under a pinned
  "highest" XLA:CPU rejects its float16 backward dots, 'F16_F16_F32');
- a materialising kernel runs only while B·N·T·S <= MATERIALIZE_LIMIT;
- a call whose scores need more than q·k/√H (`score_mods`: a scale of its own, a soft-cap,
  sinks; `SCORE_MODS`) runs only a kernel that computes them: the einsum core and "chunked"
  take all three, dpa-* the scale alone, the Pallas kernels none (`untaken_score_mods`);
- on a CUDA GPU, float16/bfloat16 with a head dim that is a multiple of 8 and <= 128
  (and even T and S when there is a mask: cuDNN's masked backward needs them) runs
  dpa-cudnn. Only this decision logic is tested (with fake processors): no GPU run yet;
- on a TPU, pallas-tpu-flash where `pallas_refusal` finds nothing against it; on a GPU (after
  the cuDNN rule), pallas-gpu-flash likewise. What it checks: the dtype, the head dim, T and S
  against the kernel's blocks, the precision, and the mask's structure (`mask_kind`: none,
  a top-left causal triangle, segment ids; a dense keep-mask's contents are data, so a dense
  mask is never "expressed"). Where it refuses, the measured rows decide as below; with no
  rows an accelerator takes "chunked", never the einsum. Only the decision logic is tested
  with fake platforms, and the wrappers (`mha_jax.pallas`) in Pallas interpret mode on a CPU:
  neither kernel has run on a GPU or TPU here.

A CPU with no rows of its device kind takes "einsum" below the guard and "chunked" with
DEFAULT_BLOCKS above it.

The choice sees whether there is a mask (`has_mask`, for cuDNN's even-length rule) and its
structure (`mask_kind`, for the Pallas kernels), not how much of it is kept: the rows were
measured without a mask. "chunked" skips the blocks a mask leaves empty (`chunked.block_census`);
every CPU row picks it, so on a CPU a sliding-window or packed mask runs it at every size. The
Pallas kernels skip the key blocks above a causal diagonal. Where "einsum", "dpa-xla" or
"dpa-cudnn" win (measured rows below the guard, 16-bit on CUDA) a sparse mask is computed
densely; no masked timing exists yet to key the choice on.
"""

from __future__ import annotations

import math
import platform as _platform
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp

from mha_jax.cache import kernel_table_path
from mha_spec.files import read_json
from mha_spec.kernel import Kernel

# The kernels by the names every row, table and command line shows; other modules use these constants.
EINSUM = "einsum"
CHUNKED = "chunked"
DPA_XLA = "dpa-xla"
DPA_CUDNN = "dpa-cudnn"
KERNELS = (EINSUM, CHUNKED, DPA_XLA, DPA_CUDNN)
"""The kernels a measured row (and `mha_jax.tune`) may name."""
PALLAS_GPU = "pallas-gpu-flash"
PALLAS_TPU = "pallas-tpu-flash"
PALLAS_KERNELS = (PALLAS_GPU, PALLAS_TPU)
"""Chosen by rule only (`pallas_refusal`); run by `mha_jax.pallas`."""
ALL_KERNELS = KERNELS + PALLAS_KERNELS
"""Every kernel `fused_attention_core` may run: what `kernel_label` and `parse_label` accept."""
DPA_IMPLEMENTATIONS = {DPA_XLA: "xla", DPA_CUDNN: "cudnn"}
"""The `implementation` argument of jax.nn.dot_product_attention that each dpa-* kernel passes."""
DEFAULT_BLOCKS = (512, 1024)
TABLE_SCHEMA = 1

MATERIALIZE_LIMIT = 2**26
"""Memory guard, not a speed rule: the largest B·N·T·S for which the fused path may run a
kernel that materialises the (B, N, T, S) scores (256 MiB in float32; its backward holds
about three such tensors). Above it the chunked kernel runs; below it the measured rows choose."""

# Widest vector ISA first: the first of these in /proc/cpuinfo's flags names the processor's ISA.
ISA_FLAGS = ("avx512f", "avx2", "avx", "sse4_2", "sve2", "sve", "asimd")


@dataclass(frozen=True)
class Processor:
    """What measured rows are keyed by: device kind, model and (CPUs) widest vector ISA."""

    device_kind: str  # "cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite", ...
    model: str  # CPU model name from /proc/cpuinfo; the device kind for accelerators
    isa: str = ""  # e.g. "avx512f", "avx2", "asimd"; "" for accelerators

    @property
    def key(self) -> str:
        return f"{self.device_kind} | {self.model} | {self.isa}"


@dataclass(frozen=True)
class Measured:
    """One measured problem: its fastest kernel (fwd and fwd+bwd together) and the chunked kernel's fastest blocks.

    Keyed by the kernel's own shape, which for K key/value heads of G = N/K query heads each is
    not the layer's: the chunked kernel runs B·K head blocks of G·T query rows (`chunked`), so a
    grouped layer (B, N, K, T, S) and an ungrouped one of B·K heads and G·T queries are one row."""

    BN: int  # B·K: batch x key/value heads (B·N for an ungrouped layer)
    T: int  # G·T: query rows per head block
    S: int
    fastest: str
    blocks: tuple[int, int] | None  # (q_chunk, k_chunk)
    head_chunk: int | None = None  # head blocks per step with those blocks (None: all B·K at once)


@dataclass(frozen=True)
class Choice:
    kernel: str
    q_chunk: int | None = None
    k_chunk: int | None = None
    why: str = ""  # the whole reason, naming the source and the row
    source: str = ""  # short, for a benchmark row: "user table", "built-in", "other cpu", "rule", "no rows"
    head_chunk: int | None = None  # the chunked kernel's head blocks per step (None: all at once)


def kernel_label(choice: Choice, *, source: bool = False) -> str:
    """The one spelling of a kernel choice that benchmark rows and `mha_jax.tune` show.

    "einsum", "dpa-xla", "dpa-cudnn", a Pallas kernel's name ("pallas-tpu-flash": its blocks
    are fixed, `TPU_BLOCK`, `gpu_blocks`), or "chunked:QxK" with its blocks (q_chunk x k_chunk),
    "chunked:QxK/hC" when it runs C of its B·K head blocks a step (head_chunk; absent: all at
    once): one token, so a tune run keys its candidates by it. source=True appends where the
    choice came from, as a benchmark row shows it: "chunked:256x512 (built-in)", "einsum (weights)".
    """
    return str(choice_kernel(choice, source=source))


def choice_kernel(choice: Choice, *, source: bool = False) -> Kernel:
    """A choice as a `mha_spec.Kernel` (what `kernel_label` prints); ValueError for a kernel that is not
    one of ALL_KERNELS or a chunked choice without its blocks."""
    if choice.kernel not in ALL_KERNELS:
        raise ValueError(f"kernel {choice.kernel!r} is not one of {ALL_KERNELS}")
    blocks = head_chunk = None
    if choice.kernel == CHUNKED:
        if choice.q_chunk is None or choice.k_chunk is None:
            raise ValueError(f"the chunked kernel's label needs its blocks, got q_chunk={choice.q_chunk} k_chunk={choice.k_chunk}")
        blocks, head_chunk = (choice.q_chunk, choice.k_chunk), choice.head_chunk
    return Kernel(choice.kernel, blocks, head_chunk, source=(choice.source or None) if source else None)


def parse_label(label: str) -> Choice:
    """`kernel_label`'s inverse (without the source): "chunked:256x512" -> Choice("chunked", 256, 512),
    "chunked:2048x512/h1" -> Choice("chunked", 2048, 512, head_chunk=1); ValueError naming the label
    for anything else."""
    k = Kernel.parse(label) if isinstance(label, str) else None
    if k is not None and k.source is None and not k.interpret and k.name in ALL_KERNELS:
        if k.name != CHUNKED and k.blocks is None:
            return Choice(k.name)
        if k.name == CHUNKED and k.blocks is not None:
            return Choice(CHUNKED, *k.blocks, head_chunk=k.head_chunk)
    raise ValueError(f"{_short(label)} is not a kernel label: one of {', '.join(k for k in ALL_KERNELS if k != CHUNKED)} "
                     f"or {CHUNKED}:QxK or {CHUNKED}:QxK/hC (positive integer blocks and head chunk)")


@dataclass(frozen=True)
class Source:
    """Rows of one processor and where they came from (the start of `Choice.why`)."""

    where: str
    rows: tuple[Measured, ...]
    label: str = ""  # `Choice.source`


EPYC = Processor("cpu", "AMD EPYC", "avx512f")
XEON = Processor("cpu", "Intel(R) Xeon(R) Processor", "avx512f")
EPYC_AVX2 = Processor("cpu", "AMD EPYC", "avx2")

# `python -m mha_jax.tune` (float32, H=64, precision "highest") on 2-core VMs shared with
# other jobs; each comment gives scores (1.00 = fastest in every run and pass that measured it).
BUILTIN: dict[str, tuple[Measured, ...]] = {
    # One quiet run each (only the tune running; load average 0.6-2.1, its own two threads), glibc's
    # allocator thresholds pinned: batch 1 and 4 (N=8, T = S = 512..4096) in
    # docs/results/kernel-table-epyc-avx512.json, grouped layers (K=2 of N=8: kernel rows G·T = 4·T
    # against S = T) in kernel-table-epyc-avx512-gqa.json. The rows they replace (measured under load 2-11,
    # no head steps among the candidates) chose 256x256 at B·N=32 T=2048: 527 ms forward against 237 ms
    # at 2048x512/h1 in a forward-only tune of that size just before.
    EPYC.key: (
        Measured(BN=8, T=512, S=512, fastest=CHUNKED, blocks=(256, 512)),  # 1.00; 512x512/h4 1.02, 512x512 1.04
        Measured(BN=8, T=1024, S=1024, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; 1024x1024/h2 1.06
        Measured(BN=8, T=2048, S=2048, fastest=CHUNKED, blocks=(2048, 1024), head_chunk=1),  # 1.02; 2048x512/h1 1.04
        Measured(BN=8, T=4096, S=4096, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; 2048x512/h1 1.01
        Measured(BN=32, T=512, S=512, fastest=CHUNKED, blocks=(512, 512), head_chunk=2),  # 1.02; 512x512/h4 1.03, all at once 256x512 1.47
        Measured(BN=32, T=1024, S=1024, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; all at once 256x512 1.34
        Measured(BN=32, T=2048, S=2048, fastest=CHUNKED, blocks=(2048, 1024), head_chunk=1),  # 1.01; all at once 256x512 1.36
        Measured(BN=32, T=4096, S=4096, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.01; all at once 256x512 1.33
        Measured(BN=2, T=2048, S=512, fastest=CHUNKED, blocks=(1024, 512)),  # 1.04; 2048x512/h1 1.06, 512x512 1.07
        Measured(BN=2, T=4096, S=1024, fastest=CHUNKED, blocks=(1024, 1024)),  # 1.00; 1024x1024/h1 1.03
        Measured(BN=2, T=8192, S=2048, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.01; 2048x512/h1 1.02
        Measured(BN=2, T=16384, S=4096, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.01; 2048x512/h1 1.02
        Measured(BN=8, T=2048, S=512, fastest=CHUNKED, blocks=(2048, 512), head_chunk=1),  # 1.00; all at once 256x512 1.13
        Measured(BN=8, T=4096, S=1024, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; all at once 256x512 1.11
        Measured(BN=8, T=8192, S=2048, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; all at once 256x512 1.08
        Measured(BN=8, T=16384, S=4096, fastest=CHUNKED, blocks=(2048, 512), head_chunk=1),  # 1.00; all at once 256x512 1.15
    ),
    # Two runs each, combined (--combine), glibc's allocator thresholds pinned (`mha_spec.allocator`), on
    # an otherwise idle machine (load average 0.7 before the first, the runs' own ~1.9 during): batch 1
    # and 4 in docs/results/kernel-table-xeon-avx512{,-run2}.json, grouped layers (K=2 of N=8: kernel rows
    # G·T = 4·T against S = T) in kernel-table-xeon-avx512-gqa{,-run2}.json. "all at once": the best
    # candidate that runs every head block in one step.
    XEON.key: (
        Measured(BN=8, T=512, S=512, fastest=CHUNKED, blocks=(256, 512)),  # 1.00; 512x512 1.03, 512x512/h4 1.09
        Measured(BN=8, T=1024, S=1024, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; all at once 256x512 1.16
        Measured(BN=8, T=2048, S=2048, fastest=CHUNKED, blocks=(2048, 1024), head_chunk=1),  # 1.00; all at once 512x512 1.11
        Measured(BN=8, T=4096, S=4096, fastest=CHUNKED, blocks=(4096, 512), head_chunk=1),  # 1.01; all at once 1024x512 1.13
        Measured(BN=32, T=512, S=512, fastest=CHUNKED, blocks=(512, 512), head_chunk=4),  # 1.01; all at once 256x512 1.27
        Measured(BN=32, T=1024, S=1024, fastest=CHUNKED, blocks=(1024, 1024), head_chunk=1),  # 1.00; all at once 256x512 1.27
        Measured(BN=32, T=2048, S=2048, fastest=CHUNKED, blocks=(2048, 1024), head_chunk=1),  # 1.00; all at once 256x512 1.25
        Measured(BN=32, T=4096, S=4096, fastest=CHUNKED, blocks=(2048, 1024), head_chunk=1),  # 1.00; all at once 512x512 1.28
        # Grouped: B=1 leaves 2 head blocks of 4·T rows, which gain little from running one at a time.
        Measured(BN=2, T=2048, S=512, fastest=CHUNKED, blocks=(2048, 512), head_chunk=1),  # 1.04; all at once 1024x512 1.05
        Measured(BN=2, T=4096, S=1024, fastest=CHUNKED, blocks=(1024, 1024)),  # 1.06; 512x1024 1.09, 1024x1024/h1 1.12
        Measured(BN=2, T=8192, S=2048, fastest=CHUNKED, blocks=(2048, 512)),  # 1.02; 1024x1024 1.03, 2048x1024/h1 1.04
        Measured(BN=2, T=16384, S=4096, fastest=CHUNKED, blocks=(2048, 1024), head_chunk=1),  # 1.02; all at once 2048x512 1.03
        Measured(BN=8, T=2048, S=512, fastest=CHUNKED, blocks=(2048, 512), head_chunk=1),  # 1.00; all at once 256x512 1.11
        Measured(BN=8, T=4096, S=1024, fastest=CHUNKED, blocks=(4096, 512), head_chunk=1),  # 1.01; all at once 512x512 1.14
        Measured(BN=8, T=8192, S=2048, fastest=CHUNKED, blocks=(8192, 512), head_chunk=1),  # 1.00; all at once 1024x512 1.10
        Measured(BN=8, T=16384, S=4096, fastest=CHUNKED, blocks=(8192, 512), head_chunk=1),  # 1.03; all at once 512x1024 1.15
    ),
    # One run (load average below 1.9); times in docs/results/kernel-table-epyc-avx2.json.
    EPYC_AVX2.key: (
        Measured(BN=32, T=256, S=256, fastest=CHUNKED, blocks=(256, 256)),  # 1.02; 128x256 1.33, dpa-xla 1.35
        Measured(BN=32, T=512, S=512, fastest=CHUNKED, blocks=(256, 512)),  # 1.06; einsum 1.14, 512x512 1.25
        Measured(BN=32, T=1024, S=1024, fastest=CHUNKED, blocks=(256, 512)),  # 1.00; 512x512 1.02, 128x256 1.20
        Measured(BN=32, T=2048, S=2048, fastest=CHUNKED, blocks=(256, 512)),  # 1.00; 512x512 1.05, 256x256 1.32
        Measured(BN=8, T=8192, S=8192, fastest=CHUNKED, blocks=(256, 512)),  # 1.00; 1024x1024 1.09, 512x512 1.10
    ),
}


def parse_cpuinfo(text: str, fallback_model: str = "") -> tuple[str, str]:
    """(model name, widest vector ISA) from the text of /proc/cpuinfo."""
    model, flags = "", set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "model name" and not model:
            model = value.strip()
        elif name in ("flags", "features") and not flags:  # x86 "flags", ARM "Features"
            flags = set(value.split())
    isa = next((f for f in ISA_FLAGS if f in flags), "")
    return model or fallback_model, isa


@lru_cache(maxsize=1)
def _cpu() -> tuple[str, str]:
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read(), _platform.processor() or _platform.machine())
    except OSError:
        return _platform.processor() or _platform.machine(), ""


def processor(device=None) -> Processor:
    """The `Processor` of `device` (default: JAX's first device)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return Processor(device.device_kind, *_cpu())
    return Processor(device.device_kind, device.device_kind, "")


def device_kind(device=None) -> str:
    """The device kind ("cpu", "NVIDIA H100 80GB HBM3", "TPU v5 lite", ...)."""
    return (device or jax.devices()[0]).device_kind


# ---------------------------------------------------------------- the user's table


MAX_SIZE = 2**31 - 1
"""The largest B·N, T or S a table row may give: the kernels index the sequence axes with
int32, and any positive size up to this keeps `_distance`'s logarithms finite."""

MAX_BLOCK = math.isqrt(MATERIALIZE_LIMIT)
"""The largest q_chunk or k_chunk a table row may give (8192): a block pair then holds at most
MATERIALIZE_LIMIT scores per (batch, head), the memory guard the chunked kernel runs under.
No multiple is required: the chunked kernel pads a ragged tail, and clamps a block to its axis."""


def _bounded_int(x, low: int, high: int) -> bool:
    # bool is an int in Python, and JSON floats (NaN, Infinity, 8.0) are not sizes.
    return type(x) is int and low <= x <= high


def _row(d) -> Measured:
    if not isinstance(d, dict):
        raise ValueError(f"a row must be an object, got {d!r}")
    for f in ("BN", "T", "S"):
        if not _bounded_int(d.get(f), 1, MAX_SIZE):
            raise ValueError(f"row field {f} must be an integer in [1, {MAX_SIZE}], got {_short(d.get(f))}")
    if d.get("fastest") not in KERNELS:
        raise ValueError(f"row field fastest must be one of {KERNELS}, got {_short(d.get('fastest'))}")
    blocks = d.get("blocks")
    if blocks is not None:
        if not isinstance(blocks, list) or len(blocks) != 2 or not all(_bounded_int(b, 1, MAX_BLOCK) for b in blocks):
            raise ValueError(f"row field blocks must be null or two integers in [1, {MAX_BLOCK}], got {_short(blocks)}")
        blocks = tuple(blocks)
    head_chunk = d.get("head_chunk")
    if head_chunk is not None and (blocks is None or not _bounded_int(head_chunk, 1, MAX_SIZE)):
        raise ValueError(f"row field head_chunk must be null, or an integer in [1, {MAX_SIZE}] beside blocks, "
                         f"got {_short(head_chunk)}")
    return Measured(BN=d["BN"], T=d["T"], S=d["S"], fastest=d["fastest"], blocks=blocks, head_chunk=head_chunk)


def _short(x) -> str:
    """repr(x), cut to 60 characters: a 400-digit integer must not flood the warning."""
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_table(data) -> dict[Processor, tuple[Measured, ...]]:
    """The user's table (parsed JSON) -> {processor: rows}; ValueError naming what is wrong."""
    if not isinstance(data, dict) or not _bounded_int(data.get("schema"), TABLE_SCHEMA, TABLE_SCHEMA):
        got = _short(data.get("schema")) if isinstance(data, dict) else repr(type(data).__name__)
        raise ValueError(f"expected an object with schema {TABLE_SCHEMA}, got schema {got}")
    entries = data.get("processors")
    if not isinstance(entries, dict):
        raise ValueError("'processors' must be an object keyed by processor")
    out = {}
    for key, entry in entries.items():
        if not isinstance(entry, dict):
            raise ValueError(f"processor {key!r}: its entry must be an object")
        fields = [entry.get(f) for f in ("device_kind", "model", "isa")]
        if not all(isinstance(f, str) for f in fields):
            raise ValueError(f"processor {key!r}: device_kind, model and isa must be strings")
        proc = Processor(*fields)
        if proc.key != key:
            raise ValueError(f"processor key {key!r} does not match its fields ({proc.key!r})")
        rows = entry.get("rows")
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"processor {key!r}: 'rows' must be a non-empty list")
        try:
            out[proc] = tuple(_row(r) for r in rows)
        except ValueError as e:
            raise ValueError(f"processor {key!r}: {e}") from None
    return out


def load_user_table(path: Path | None = None) -> dict[Processor, tuple[Measured, ...]]:
    """The user's measured rows; {} when there is no file. A file that cannot be read or parsed
    is ignored with a UserWarning naming it (the built-in rows then apply): never an error."""
    path = Path(path or kernel_table_path())
    try:
        return parse_table(read_json(path))
    except FileNotFoundError:
        return {}
    except ValueError as e:  # files.JSONFileError (unreadable, not UTF-8, too deep) is one
        warnings.warn(f"mha_jax kernel table {path} is ignored ({e}); using the built-in rows. "
                      "Rerun `python -m mha_jax.tune` or delete the file.", UserWarning, stacklevel=2)
        return {}


def sources_for(proc: Processor, user: dict[Processor, tuple[Measured, ...]], user_path: str = "the user's table") -> tuple[Source, ...]:
    """The rows `choose` picks from, in the order the module docstring gives."""
    if proc in user:
        return (Source(f"user table {user_path} for {proc.model} ({proc.isa or proc.device_kind})", user[proc], "user table"),)
    if proc.key in BUILTIN:
        return (Source(f"built-in rows for {proc.model} ({proc.isa or proc.device_kind})", BUILTIN[proc.key], "built-in"),)
    others = {p: r for p, r in user.items() if p.device_kind == proc.device_kind}
    for key, rows in BUILTIN.items():
        other = Processor(*key.split(" | "))
        if other.device_kind == proc.device_kind and other not in others:
            others[other] = rows
    return tuple(Source(f"no rows for {proc.model} ({proc.isa or '-'}): rows of {p.model} ({p.isa or '-'})", rows,
                        f"other {proc.device_kind}") for p, rows in others.items())


# ---------------------------------------------------------------- the choice


def kernel_space(B: int, N: int, T: int, S: int, kv_heads: int | None = None) -> tuple[int, int, int]:
    """(B·K, G·T, S): the shape a table row is keyed by (`Measured`) for a layer of N query heads and
    kv_heads K (None: K = N) key/value heads, G = N/K. ValueError when K does not divide N."""
    K = N if kv_heads is None else kv_heads
    if type(K) is not int or K < 1 or N % K:
        raise ValueError(f"kv_heads must be a positive integer dividing num_heads N={N}, got {kv_heads!r}")
    return B * K, (N // K) * T, S


def _distance(row: Measured, BN: int, T: int, S: int) -> float:
    return abs(math.log(BN / row.BN)) + abs(math.log(T / row.T)) + abs(math.log(S / row.S))


def _cudnn_allowed(platform: str, dtype, T: int, S: int, H: int, has_mask: bool) -> bool:
    if platform not in ("gpu", "cuda") or jnp.dtype(dtype) not in (jnp.float16, jnp.bfloat16):
        return False
    if H % 8 or H > 128:  # cuDNN flash attention's head-dim limit (256 from Hopper on; 128 is safe)
        return False
    return not has_mask or (T % 2 == 0 and S % 2 == 0)


# ---------------------------------------------------------------- the Pallas kernels' rule

# The structure of a call's keep-mask, as the caller knows it from its keywords (never from the
# mask's values): `fused_attention_core` derives it from is_causal/segment_ids/key_segment_ids.
MASK_NONE = "none"
MASK_CAUSAL = "causal"  # s <= t (top-left; with T = S also bottom-right)
MASK_SEGMENTS = "segments"  # one set of segment ids for queries and keys (T = S)
MASK_KEY_SEGMENTS = "key-segments"  # segment ids for the queries and separate ones for the keys
MASK_CAUSAL_SEGMENTS = "causal+segments"
MASK_CAUSAL_KEY_SEGMENTS = "causal+key-segments"
MASK_DENSE = "dense"  # anything else: a keep-mask given as data, a window, bottom-right causal with T != S
MASK_STRUCTURES = (MASK_NONE, MASK_CAUSAL, MASK_SEGMENTS, MASK_KEY_SEGMENTS, MASK_CAUSAL_SEGMENTS,
                   MASK_CAUSAL_KEY_SEGMENTS, MASK_DENSE)

# What each Pallas kernel can express: the GPU kernel takes one segment-id array for queries and
# keys, the TPU kernel a (queries, keys) pair.
_EXPRESSIBLE = {
    PALLAS_GPU: (MASK_NONE, MASK_CAUSAL, MASK_SEGMENTS, MASK_CAUSAL_SEGMENTS),
    PALLAS_TPU: (MASK_NONE, MASK_CAUSAL, MASK_SEGMENTS, MASK_KEY_SEGMENTS, MASK_CAUSAL_SEGMENTS,
                 MASK_CAUSAL_KEY_SEGMENTS),
}

TPU_BLOCK = 128
"""Every block of pallas-tpu-flash, forward and backward (the kernel's defaults): its key blocks
must be multiples of 128 lanes, and its backward tiles the row statistics by block_k // 128."""
GPU_BLOCK = 128
GPU_BACKWARD_BLOCK = 32
"""pallas-gpu-flash's blocks (the kernel's defaults), each clamped to the sequence: min(128, L)
forward, min(32, L) in the backward; Triton needs each a power of two >= 16 that divides L."""
_GPU_MIN_BLOCK = 16
_GPU_HEAD_DIMS = (16, 256)  # Triton's dot needs >= 16 along the contraction; above 256 the tiles outgrow shared memory

# The strings jax.default_matmul_precision takes that the Pallas kernels' dots then follow.
_PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32", "fastest", "bfloat16_3x")


def resolve_mask_kind(*, has_mask: bool, mask_kind: str | None = None) -> str:
    """The call's mask structure: mask_kind as given (one of MASK_STRUCTURES), or, when None, what
    has_mask alone implies (MASK_DENSE or MASK_NONE). ValueError when the two disagree."""
    if mask_kind is None:
        return MASK_DENSE if has_mask else MASK_NONE
    if mask_kind not in MASK_STRUCTURES:
        raise ValueError(f"mask_kind={mask_kind!r} is not one of {MASK_STRUCTURES}")
    if has_mask != (mask_kind != MASK_NONE):
        raise ValueError(f"has_mask={has_mask} contradicts mask_kind={mask_kind!r}")
    return mask_kind


def precision_name(precision) -> str | None:
    """The jax.default_matmul_precision string that gives `precision` (None: None, the default).

    The Pallas kernels pass no precision to their dots, so `mha_jax.pallas` traces them under
    this setting. A ValueError for what no such string names (two different per-operand
    precisions, a dot algorithm)."""
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)) and len(precision) == 2 and precision[0] == precision[1]:
        precision = precision[0]
    if isinstance(precision, jax.lax.Precision):
        return precision.name.lower()
    if isinstance(precision, str) and precision.lower() in _PRECISION_NAMES:
        return precision.lower()
    raise ValueError(f"precision {precision!r} has no jax.default_matmul_precision name ({', '.join(_PRECISION_NAMES)})")


def gpu_blocks(L: int) -> tuple[int, int] | None:
    """pallas-gpu-flash's (forward, backward) block along a sequence of length L, or None when
    either is not a power of two >= 16 dividing L."""
    blocks = (min(GPU_BLOCK, L), min(GPU_BACKWARD_BLOCK, L))
    if all(b >= _GPU_MIN_BLOCK and b & (b - 1) == 0 and L % b == 0 for b in blocks):
        return blocks
    return None


def pallas_refusal(kernel: str, *, dtype, T: int, S: int, H: int, mask_kind: str, precision=None) -> str | None:
    """Why `kernel` (PALLAS_GPU or PALLAS_TPU) cannot run this call, or None when it can; pure."""
    dtype = jnp.dtype(dtype)
    if kernel == PALLAS_TPU:
        dtypes, what = (jnp.float32, jnp.bfloat16), "float32 and bfloat16 (its softmax is float32)"
    elif kernel == PALLAS_GPU:
        dtypes, what = (jnp.float32, jnp.float16, jnp.bfloat16), "float32, float16 and bfloat16 (its softmax is float32)"
    else:
        raise ValueError(f"kernel {kernel!r} is not one of {PALLAS_KERNELS}")
    if dtype not in dtypes:
        return f"{dtype.name}: it runs {what}"
    if mask_kind not in _EXPRESSIBLE[kernel]:
        return f"a {mask_kind} mask: it expresses {', '.join(_EXPRESSIBLE[kernel])}"
    if kernel == PALLAS_TPU:
        if T % TPU_BLOCK or S % TPU_BLOCK:
            return f"T={T}, S={S}: both must be multiples of its {TPU_BLOCK} blocks"
        if H > TPU_BLOCK and H % TPU_BLOCK:
            return f"head dim {H}: it takes H <= {TPU_BLOCK} or a multiple of {TPU_BLOCK}"
    else:
        if T != S:
            return f"T={T} != S={S}: its fused backward needs as many query blocks as key blocks"
        if gpu_blocks(T) is None:
            return (f"T=S={T}: its blocks min({GPU_BLOCK}, T) and min({GPU_BACKWARD_BLOCK}, T) must be powers of two "
                    f">= {_GPU_MIN_BLOCK} dividing T")
        if not _GPU_HEAD_DIMS[0] <= H <= _GPU_HEAD_DIMS[1]:
            return f"head dim {H}: it takes {_GPU_HEAD_DIMS[0]} <= H <= {_GPU_HEAD_DIMS[1]}"
    try:
        precision_name(precision)
    except ValueError as e:
        return str(e)
    return None


_PALLAS_BY_PLATFORM = {"tpu": PALLAS_TPU, "gpu": PALLAS_GPU, "cuda": PALLAS_GPU}

# ---------------------------------------------------------------- what the scores need beyond q·k / √H

SCORE_MODS = ("scale", "softcap", "sinks")
"""What a call may ask of its scores beyond q·k/√H and the mask: a softmax scale of its own, soft-capped
logits, attention sinks (`mha_spec.AttentionConfig`)."""
_TAKES = {EINSUM: frozenset(SCORE_MODS), CHUNKED: frozenset(SCORE_MODS), DPA_XLA: frozenset({"scale"}),
          DPA_CUDNN: frozenset({"scale"}), PALLAS_GPU: frozenset(), PALLAS_TPU: frozenset()}
# jax.nn.dot_product_attention takes scale= but no cap and no extra softmax column; `mha_jax.pallas`
# passes the kernels' sm_scale as 1/√H.


def score_mods_of(*, scale=None, softcap=None, sinks=None) -> tuple[str, ...]:
    """The SCORE_MODS a call asks for: scale and softcap where not None, sinks where given (the (N,) array
    a core takes, or a layer's `mha_spec.AttentionConfig.sinks` True)."""
    given = {"scale": scale is not None, "softcap": softcap is not None, "sinks": sinks is not None and sinks is not False}
    return tuple(m for m in SCORE_MODS if given[m])


def untaken_score_mods(kernel: str, score_mods) -> tuple[str, ...]:
    """Those of score_mods (SCORE_MODS entries) that `kernel` cannot compute; ValueError for others."""
    unknown = sorted(set(score_mods) - set(SCORE_MODS))
    if unknown:
        raise ValueError(f"score_mods {unknown} are not among {SCORE_MODS}")
    return tuple(m for m in SCORE_MODS if m in score_mods and m not in _TAKES.get(kernel, SCORE_MODS))


def choose(*, platform: str, sources: tuple[Source, ...], dtype, B: int, N: int, T: int, S: int, H: int, has_mask: bool,
           materialize_limit: int, mask_kind: str | None = None, precision=None, kv_heads: int | None = None,
           score_mods=()) -> Choice:
    """The kernel and chunk sizes for one fused call; pure (no device or file is read).

    mask_kind: the mask's structure (MASK_STRUCTURES; None: what has_mask implies, see
    `resolve_mask_kind`); precision: the call's, which a Pallas kernel must be able to follow;
    kv_heads: K key/value heads (None: N), the table rows compared in `kernel_space`; score_mods:
    the SCORE_MODS the call asks for (a kernel that cannot compute one is never chosen; `why` says so)."""
    dtype = jnp.dtype(dtype)
    space = kernel_space(B, N, T, S, kv_heads)
    kind = resolve_mask_kind(has_mask=has_mask, mask_kind=mask_kind)
    untaken = {k: untaken_score_mods(k, score_mods) for k in ALL_KERNELS}
    if B == 0 or T == 0:
        return Choice(CHUNKED, *DEFAULT_BLOCKS, why="B = 0 or T = 0: the chunked kernel returns the empty context", source="rule")
    if _cudnn_allowed(platform, dtype, T, S, H, has_mask) and not untaken[DPA_CUDNN]:
        return Choice(DPA_CUDNN, why="CUDA GPU, 16-bit, head dim and mask within cuDNN's limits", source="rule")
    pallas = _PALLAS_BY_PLATFORM.get(platform)
    refused = ""
    if pallas is not None:
        refusal = pallas_refusal(pallas, dtype=dtype, T=T, S=S, H=H, mask_kind=kind, precision=precision)
        if refusal is None and untaken[pallas]:
            refusal = f"it cannot compute {', '.join(untaken[pallas])}"
        if refusal is None:
            return Choice(pallas, why=f"{platform}: {dtype.name}, T={T}, S={S}, H={H} and a {kind} mask fit {pallas}",
                          source="rule")
        refused = f"{pallas} refused ({refusal})"
    fits = B * N * T * S <= materialize_limit
    allowed = {CHUNKED}
    if fits:
        allowed.add(EINSUM)
        if dtype in (jnp.float32, jnp.bfloat16) and not untaken[DPA_XLA]:
            allowed.add(DPA_XLA)
    ranked = sorted(((_distance(r, *space), n, r) for n, src in enumerate(sources) for r in src.rows), key=lambda x: x[:2])
    if not ranked:
        if pallas is not None:  # an accelerator: never a materialising kernel by default
            return Choice(CHUNKED, *DEFAULT_BLOCKS, why=f"{refused}; no measured rows for this device kind: chunked",
                          source="no rows")
        kernel = EINSUM if fits else CHUNKED
        blocks = DEFAULT_BLOCKS if kernel == CHUNKED else (None, None)
        return Choice(kernel, *blocks, why="no measured rows for this device kind", source="no rows")
    _, n, row = ranked[0]
    tiled = next((r for _, _, r in ranked if r.blocks is not None), None)  # the nearest row that timed the chunked kernel
    blocks, head_chunk = (tiled.blocks, tiled.head_chunk) if tiled else (DEFAULT_BLOCKS, None)
    kernel = row.fastest if row.fastest in allowed else (EINSUM if fits else CHUNKED)
    why = f"{sources[n].where}: nearest measured B·N={row.BN} T={row.T} S={row.S} ({row.fastest} fastest)"
    if space[0] != B * N:
        why += f" to the kernel's B·K={space[0]} G·T={space[1]} S={S}"
    if kernel != row.fastest:
        why += f"; {row.fastest} not allowed for {dtype.name} at B·N·T·S={B * N * T * S}"
        if untaken.get(row.fastest):
            why += f" with {', '.join(untaken[row.fastest])}"
    if refused:
        why += f"; {refused}"
    if kernel != CHUNKED:
        return Choice(kernel, why=why, source=sources[n].label)
    return Choice(kernel, *blocks, why=why, source=sources[n].label, head_chunk=head_chunk)


def fused_choice(B: int, N: int, T: int, S: int, H: int, dtype, *, has_mask: bool, mask_kind: str | None = None,
                 precision=None, device=None, kv_heads: int | None = None, score_mods=()) -> Choice:
    """What `fused_attention_core` runs for these sizes on `device` (default: JAX's first device).

    mask_kind: the mask's structure, one of MASK_STRUCTURES (None: MASK_DENSE with a mask,
    MASK_NONE without); precision: the call's matmul precision (None: jax's default); kv_heads:
    the key/value heads K (None: N); score_mods: the SCORE_MODS the call asks for."""
    device = device or jax.devices()[0]
    path = kernel_table_path()
    sources = sources_for(processor(device), load_user_table(path), str(path))
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    return choose(platform=device.platform, sources=sources, dtype=dtype, B=B, N=N, T=T, S=S, H=H,
                  has_mask=has_mask, materialize_limit=MATERIALIZE_LIMIT, mask_kind=mask_kind, precision=precision,
                  kv_heads=kv_heads, score_mods=score_mods)


WEIGHTS = "weights"
"""`Choice.source` of the module with need_weights=True: it returns the weights, so the einsum core runs."""


def module_choice(B: int, N: int, T: int, S: int, H: int, dtype, *, has_mask: bool, need_weights: bool,
                  mask_kind: str | None = None, precision=None, device=None, kv_heads: int | None = None,
                  score_mods=()) -> Choice:
    """What `mha_jax.MultiHeadAttention` runs for these sizes: the einsum core when it returns the
    weights, else `fused_choice` (what `fused_attention_core` asks); score_mods: the SCORE_MODS of the
    layer (`score_mods_of` its scale, softcap and sinks)."""
    if need_weights:
        return Choice(EINSUM, why="need_weights=True: the weights are returned, so the einsum core materialises them",
                      source=WEIGHTS)
    return fused_choice(B, N, T, S, H, dtype, has_mask=has_mask, mask_kind=mask_kind, precision=precision, device=device,
                        kv_heads=kv_heads, score_mods=score_mods)

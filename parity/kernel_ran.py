"""Which attention kernel a call really ran, read off what the framework executed (not off a rule).

torch (`torch_observer`): the profiler's aten op names of one call. SDPA dispatches to one backend
op (`SDPA_BACKEND_OPS`: aten::_scaled_dot_product_flash_attention_for_cpu, ..._efficient_attention,
..._cudnn_attention, ..._attention_math) and the profiler records it even where the backend runs
inside another kernel (nn.MultiheadAttention's native fast path) or a compiled graph. The private
`torch._fused_sdp_choice` would need SDPA's arguments, which only a torch-function mode can catch,
and such a mode switches nn.MultiheadAttention off its fast path (`has_torch_function`): it would
change what it observes, so it is not used. The profiler's first use in a process costs about 2 s
(later ones ~10 ms); this build of kineto writes two "USDT:" lines to fd 2 per profile, which
`torch_observer` filters out (everything else written meanwhile is passed on afterwards).
A call's label: "sdpa:flash" (the SDPA backends that ran, "+"-joined), else "bmm-softmax" when
a softmax op ran (the weights materialised), else "unknown".

JAX (`jax_engine`): the program's jaxpr (a trace, no compile) and, where one exists, the compiled
program's text (`jax.jit(f).lower(...).compile().as_text()`): a `pallas_call` in the jaxpr is a
Pallas kernel, run in interpret mode where its `interpret` parameter is set or the platform is a
CPU (Pallas has no CPU back end), else as the custom call the text names (Mosaic `tpu_custom_call`,
Triton `__gpu$xla.gpu.triton`); cuDNN's fused attention is the `dot_product_attention_fwd`
primitive in the jaxpr or a `__cudnn$fmha` custom call in the text; anything else is "xla" (XLA's own
fusions: the einsum, the chunked kernel, dot_product_attention(implementation="xla")).

`verdict(requested, ran)` turns the kernel a row asked for (a `mha_jax.kernels` label, torch's "sdpa")
and what ran into the row's `kernel` and, when they disagree, a message ("requested dpa-cudnn, ran xla").
Imports torch and jax lazily: each function imports only its own framework.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Callable

from mha_spec import Kernel

SDPA = "sdpa"  # F.scaled_dot_product_attention
BMM_SOFTMAX = "bmm-softmax"  # baddbmm, softmax, bmm: the weights materialised

UNKNOWN = "unknown"

# ---------------------------------------------------------------- torch

# aten op -> SDPA backend (torch.nn.attention.SDPBackend's names, lower case)
SDPA_BACKEND_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_flash_attention_forward": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_efficient_attention_forward": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_attention_math_for_mps": "math",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
# Softmax ops outside SDPA: attention computed with its weights materialised.
SOFTMAX_OPS = ("_softmax", "softmax", "_safe_softmax", "_masked_softmax")
_NOISE = "USDT:"  # kineto's start/stop lines in this torch build


def _op(name: str) -> str:
    """"aten::_softmax" / "aten._softmax.default" -> "_softmax"."""
    name = name.split("::", 1)[-1]
    if name.startswith("aten."):
        name = name[len("aten."):]
    return name.split(".", 1)[0]


def torch_label(op_names) -> str:
    """The label of one call from the aten op names it ran (see the module docstring)."""

    ops = [_op(n) for n in op_names]
    backends = sorted({SDPA_BACKEND_OPS[o] for o in ops if o in SDPA_BACKEND_OPS})
    if backends:
        return f"{SDPA}:{'+'.join(backends)}"
    if any(o in SOFTMAX_OPS for o in ops):
        return BMM_SOFTMAX
    return UNKNOWN


@contextlib.contextmanager
def _quiet_fd2():
    """fd 2 into a file for the duration; afterwards its lines, but kineto's, go back to fd 2."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (an embedded interpreter): nothing to filter
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


class TorchObserved:
    """What `torch_observer` saw: the aten op names, and their label (filled when the block ends); with
    record_shapes, `sdpa_calls`: (op name, input shapes, concrete inputs) of every SDPA op (how its mask came)."""

    def __init__(self):
        self.ops: list[str] = []
        self.sdpa_calls: list[tuple] = []

    @property
    def label(self) -> str:
        return torch_label(self.ops)


@contextlib.contextmanager
def torch_observer(record_shapes: bool = False):
    """`with torch_observer() as seen: call()`; then `seen.label` ("sdpa:flash", "bmm-softmax", "unknown")."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    seen = TorchObserved()
    with _quiet_fd2():
        with profile(activities=activities, record_shapes=record_shapes) as prof:
            yield seen
    seen.ops = sorted({e.name for e in prof.events()})
    if record_shapes:
        seen.sdpa_calls = [(e.name, list(e.input_shapes or ()), list(getattr(e, "concrete_inputs", None) or ()))
                           for e in prof.events() if "scaled_dot_product" in e.name]


# ---------------------------------------------------------------- JAX

XLA = "xla"
CUDNN = "cudnn-fmha"
PALLAS_INTERPRET = "pallas (interpret)"
PALLAS_MOSAIC = "pallas (mosaic)"
PALLAS_TRITON = "pallas (triton)"
PALLAS_MOSAIC_GPU = "pallas (mosaic-gpu)"
PALLAS = "pallas"  # compiled, back end not named by the text
_CUDNN_PRIMITIVES = ("dot_product_attention_fwd", "dot_product_attention_fp8_fwd")
_CUSTOM_CALLS = (("__cudnn$fmha", CUDNN), ("tpu_custom_call", PALLAS_MOSAIC), ("__gpu$xla.gpu.triton", PALLAS_TRITON),
                 ("triton_kernel_call", PALLAS_TRITON), ("mosaic_gpu", PALLAS_MOSAIC_GPU))


def _eqns(jaxpr):
    import jax.extend.core as jcore

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def jax_engine(jaxpr=None, text: str = "", platform: str = "cpu") -> str:
    """What runs the attention of a program: one of XLA, CUDNN and the PALLAS_* names.

    jaxpr: the program's (`jax.jit(f).trace(...).jaxpr`, a ClosedJaxpr or Jaxpr), or None; text: the
    compiled (or lowered) program's text, or ""; platform: the device's ("cpu", "gpu", "tpu")."""
    pallas = interpret = cudnn = False
    for eqn in _eqns(jaxpr) if jaxpr is not None else ():
        name = eqn.primitive.name
        if name == "pallas_call":
            pallas = True
            flag = eqn.params.get("interpret")
            interpret = interpret or (flag is not None and flag is not False)
        elif name in _CUDNN_PRIMITIVES:
            cudnn = True
    found = [engine for target, engine in _CUSTOM_CALLS if target in text]
    if pallas and (interpret or platform == "cpu"):
        return PALLAS_INTERPRET
    pallas_calls = [e for e in found if e.startswith(PALLAS)]
    if pallas_calls:
        return pallas_calls[0]
    if pallas:
        return PALLAS
    if cudnn or CUDNN in found:
        return CUDNN
    return XLA


def expected_engine(kernel: str) -> str:
    """The engine a `mha_jax.kernels` kernel name runs on: dpa-cudnn cuDNN, the Pallas kernels Pallas,
    the rest XLA."""
    from mha_jax import kernels

    if kernel == kernels.DPA_CUDNN:
        return CUDNN
    if kernel in kernels.PALLAS_KERNELS:
        return PALLAS
    return XLA


def _same_engine(expected: str, ran: str) -> bool:
    return ran == expected or (expected == PALLAS and ran.startswith(PALLAS))


def jax_verdict(requested: str | None, ran: str) -> tuple[str, str]:
    """(the row's kernel, a message or "") for a JAX row that asked for `requested` (a kernel_label,
    perhaps with its "(source)"; None or a name that is no kernel: nothing was asked) and ran on `ran`
    (`jax_engine`). A request met keeps its label, "pallas-gpu-flash (interpret)" in interpret mode; one not
    met gives the engine that ran and says so."""
    from mha_jax import kernels

    asked = Kernel.parse(requested or "")
    if asked.name not in kernels.ALL_KERNELS:
        return ran, ""
    if not _same_engine(expected_engine(asked.name), ran):
        return ran, f"requested {requested}, ran {ran}"
    if ran == PALLAS_INTERPRET:
        return str(replace(asked, interpret=True)), ""
    return requested, ""


def torch_verdict(requested: str | None, ran: str) -> tuple[str, str]:
    """(the row's kernel, a message or "") for a torch row: `requested` "sdpa" (the fused path) is met by any
    SDPA backend, "bmm-softmax (weights)" by a softmax outside SDPA; any other request (a peer's name, a
    user's layer) asks nothing, and the row says what ran."""

    if requested == SDPA:
        return ran, "" if ran.startswith(f"{SDPA}:") else f"requested {SDPA}, ran {ran}"
    if requested and Kernel.parse(requested).name == BMM_SOFTMAX:
        return (requested, "") if ran == BMM_SOFTMAX else (ran, f"requested {requested}, ran {ran}")
    return ran, ""


def jax_program_engine(fn, *args, device=None) -> str:
    """`jax_engine` of jax.jit(fn) traced on args (no compile): the harness's cheap reading."""
    import jax

    traced = jax.jit(fn).trace(*args)
    platform = device.platform if device is not None else jax.default_backend()
    return jax_engine(traced.jaxpr, "", platform)


# ---------------------------------------------------------------- the benchmark's record


@dataclass
class BenchKernel:
    """A benchmark row's `kernel` (`parity.bench.measure.Bench.kernel`): the requested label, and how to read
    what ran once the bench is prepared (its compile and its untimed output call are where it is seen).

    observe() -> (kernel, message), or None when nothing was observed (the bench failed before)."""

    requested: str | None
    observe: Callable[[], tuple[str, str] | None]

    def fields(self) -> tuple[str | None, str]:
        """(the row's kernel, a message or ""): what ran, else the request."""
        try:
            seen = self.observe()
        except Exception as e:  # noqa: BLE001 - the reading is a diagnosis; its failure must not lose the row
            return self.requested, f"the kernel that ran could not be read: {type(e).__name__}: {e}"[:300]
        return (self.requested, "") if seen is None else seen


def row_kernel(kernel) -> tuple[str | None, str]:
    """(kernel, message) of a Bench's `kernel`: a BenchKernel, or a plain label (a fake bench, a user's)."""
    return kernel.fields() if isinstance(kernel, BenchKernel) else (kernel, "")


# ---------------------------------------------------------------- the harness's reading


@contextlib.contextmanager
def jax_choices():
    """`with jax_choices() as made: trace()`: every `mha_jax.kernels.Choice` that `kernels.fused_choice` made
    for our module meanwhile (what `fused_attention_core` dispatched on)."""
    from mha_jax import kernels

    made: list[str] = []
    original = kernels.fused_choice

    def spy(*a, **kw):
        choice = original(*a, **kw)
        made.append(choice)
        return choice

    kernels.fused_choice = spy
    try:
        yield made
    finally:
        kernels.fused_choice = original


def jax_row_kernel(program, args, device, ours: bool, need_weights: bool) -> tuple[str, str]:
    """(kernel, message) of one JAX implementation's forward program (traced on args, not compiled): the
    engine from the jaxpr, checked against our module's own choice when `ours`."""
    import jax
    from mha_jax import kernels

    with jax_choices() as choices:
        traced = jax.jit(program).trace(*args)
    made = [kernels.kernel_label(c) for c in choices]
    ran = jax_engine(traced.jaxpr, "", device.platform)
    if not ours:
        return ran, ""
    if not made:  # no fused call: the weights path's einsum core (`kernels.module_choice`)
        made = [kernels.kernel_label(kernels.Choice(kernels.EINSUM))] if need_weights else []
    requested = "+".join(dict.fromkeys(made))
    if not requested:
        return ran, ""
    kernel, note = jax_verdict(made[0], ran)
    return (kernel if len(set(made)) == 1 else requested), note

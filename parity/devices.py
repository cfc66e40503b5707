"""Where a run goes: one meaning of `auto` for the harness, the benchmark and every adapter.

`auto` is the best present device: a GPU, else a TPU, else the CPU. Presence is read
from device nodes first (no framework import, so the benchmark's parent process can
plan a sweep cheaply), then, with `probe=True`, confirmed by the frameworks
themselves: a device node without a framework backend is an absent device, with the
reason.
"""

from __future__ import annotations

import glob
from dataclasses import MISSING, asdict, dataclass, fields

DEVICES = ("auto", "cpu", "gpu", "tpu")


@dataclass(frozen=True)
class DevicePlan:
    requested: str  # what the user asked for
    name: str  # what runs: cpu | gpu | tpu
    torch_device: str | None  # "cpu" | "cuda" | None (absent)
    jax_platform: str | None  # "cpu" | "gpu" | "tpu" | None (absent)
    skip_reason: str = ""  # non-empty: the device is absent, everything on it is a skip
    note: str = ""  # e.g. torch runs on the CPU as the reference beside a TPU

    def to_dict(self) -> dict:
        """The plan as JSON-ready fields: what the benchmark's parent sends its workers and records
        in a run's environment; `from_dict` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DevicePlan:
        """The plan `to_dict` wrote; ValueError naming the missing or unknown keys, TypeError for a
        field that is not a string (or None where a framework has no device)."""
        if not isinstance(data, dict):
            raise TypeError(f"a DevicePlan is read from a dict, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [k for k in required if k not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(f"DevicePlan fields: missing {missing}, unknown {unknown} (fields: {names})")
        optional = ("torch_device", "jax_platform")  # None: that framework has no device in the plan
        for k, v in data.items():
            if not (isinstance(v, str) or (v is None and k in optional)):
                raise TypeError(f"DevicePlan.{k} must be a string{' or None' if k in optional else ''}, got {v!r}")
        return cls(**data)


def device_label(device) -> str:
    """The one spelling of a device in every row: "<cpu|gpu|tpu>:<index>". Takes a torch.device, a
    jax Device or a string ("cpu", "cuda:1", a DevicePlan's name), so torch's "cpu" and JAX's
    "cpu:0" are the same device in a report."""
    if hasattr(device, "platform") and hasattr(device, "id"):  # a jax Device
        kind, index = device.platform, device.id
    elif hasattr(device, "type") and hasattr(device, "index"):  # a torch.device
        kind, index = device.type, device.index
    elif isinstance(device, str):
        kind, _, rest = device.lower().partition(":")
        index = int(rest) if rest.isdigit() else None
    else:
        raise TypeError(f"device_label takes a torch.device, a jax Device or a string, got {type(device).__name__}")
    kind = {"cuda": "gpu", "rocm": "gpu"}.get(kind, kind)
    if kind not in DEVICES[1:]:
        raise ValueError(f"device {device!r} is none of {DEVICES[1:]}")
    return f"{kind}:{index or 0}"


def device_nodes() -> dict[str, str | None]:
    """{device: None if a device node is present, else why not}; no framework imported."""
    found = {"cpu": None}
    gpu = glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd")
    found["gpu"] = None if gpu else "no GPU found (no /dev/nvidia* or /dev/kfd device node)"
    tpu = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    found["tpu"] = None if tpu else "no TPU found (no /dev/accel* or /dev/vfio device)"
    return found


def _jax_has(platform: str) -> bool:
    import jax

    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # jax raises when the backend is absent
        return False


def _probe(name: str) -> DevicePlan:
    """Ask the frameworks whether they can run on `name` (imports torch and jax)."""
    import torch

    cuda = torch.cuda.is_available()
    if name == "gpu":
        if not _jax_has("gpu"):
            why = "jax has no gpu backend (pip install 'mha-parity[cuda]')"
            return DevicePlan("", "gpu", "cuda" if cuda else None, None, skip_reason=f"device gpu: {why}")
        note = "" if cuda else "torch has no CUDA here, so torch runs on cpu as the reference"
        return DevicePlan("", "gpu", "cuda" if cuda else "cpu", "gpu", note=note)
    if name == "tpu":
        if not _jax_has("tpu"):
            return DevicePlan("", "tpu", None, None, skip_reason="device tpu not present: jax has no tpu backend")
        return DevicePlan("", "tpu", "cpu", "tpu", note="torch has no TPU backend here: it runs on cpu as the reference")
    return DevicePlan("", "cpu", "cpu", "cpu")


def resolve_device(requested: str, *, probe: bool = True) -> DevicePlan:
    """The plan for `requested` (auto | cpu | gpu | tpu); an absent device gets a skip_reason, not an error."""
    if requested not in DEVICES:
        raise ValueError(f"device {requested!r} is not one of {DEVICES}")
    nodes = device_nodes()
    name = requested
    if requested == "auto":
        name = next(d for d in ("gpu", "tpu", "cpu") if nodes[d] is None)
    if nodes[name] is not None:
        return DevicePlan(requested, name, None, None, skip_reason=f"device {name} not present: {nodes[name]}")
    if not probe:
        torch_device = {"cpu": "cpu", "gpu": "cuda", "tpu": "cpu"}[name]
        return DevicePlan(requested, name, torch_device, name)
    plan = _probe(name)
    return DevicePlan(requested, plan.name, plan.torch_device, plan.jax_platform, plan.skip_reason, plan.note)

"""Reading a safetensors weight file, with every error naming the file and what is wrong with it.

Shared by parity.convert.load (our own files) and parity.layouts.read_layout and
read_checkpoint (one block of a Hugging Face checkpoint: one file, or the shards of a
checkpoint directory). Tensors are read lazily, one key at a time, and only in
the dtypes a canonical state dict holds: a float8 (or integer, or any other) tensor is
a ValueError naming its key and dtype, never a silent cast. A file that is not
safetensors is never unpickled: a pickle is recognised by its first bytes and named.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from mha_spec.files import parse_json
from parity.canonical import tensor_to_numpy

# safetensors' dtype names -> the NumPy dtype each is read as; every other dtype is refused by name.
FILE_DTYPES = {
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
_SUPPORTED = "float16, bfloat16, float32 and float64"
BUFFER_DTYPES = ("BOOL", "U8")  # read by WeightFile.get_buffer besides FILE_DTYPES


def file_path(path) -> str:
    """A str, bytes or os.PathLike path as a str; anything else is a TypeError."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"a weight file path must be a str, bytes or os.PathLike, got {type(path).__name__}")
    return os.fsdecode(os.fspath(path))


def path_problem(path: str) -> str | None:
    """Why `path` cannot be opened, in words (None: it can be reached). A path through a loop of
    symbolic links is said to be one: os.path.exists says only False, as for a missing file."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a loop of symbolic links (too many levels of symbolic links)"
        if e.errno == errno.ENOENT and os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
        if e.errno == errno.ENOENT:
            return "no such file or directory"
        return (e.strerror or type(e).__name__).lower()
    return None


def path_error(path: str, problem: str, missing: str) -> OSError:
    """The error for a path_problem: FileNotFoundError saying `missing` when nothing is there,
    else an OSError in path_problem's words (a loop of symbolic links, a link to nowhere, ...)."""
    if problem == "no such file or directory":
        return FileNotFoundError(f"{path}: {missing}")
    return (FileNotFoundError if "does not exist" in problem else OSError)(f"{path}: {problem}")


@dataclass(frozen=True)
class WeightFile:
    """An open safetensors file: its metadata, its keys, and its tensors read one at a time."""

    path: str
    metadata: dict
    keys: frozenset
    _handle: object = field(repr=False)

    def get(self, key: str) -> np.ndarray:
        """One tensor as NumPy, in its stored dtype; a dtype outside FILE_DTYPES is a ValueError naming it."""
        if key not in self.keys:
            raise KeyError(f"{self.path}: no tensor {key!r}")
        dtype = self._handle.get_slice(key).get_dtype()
        if dtype not in FILE_DTYPES:
            kind = " (float8): float8 weights are not supported, dequantize them first" if dtype.startswith("F8") else ""
            raise ValueError(f"{self.path}: tensor {key!r} has dtype {dtype}{kind}; only {_SUPPORTED} tensors are read")
        if dtype == "BF16":  # safetensors' NumPy reader has not always read BF16; its torch reader has, bit for bit
            arr = _read_bf16(self.path, key)
        else:
            arr = self._handle.get_tensor(key)
        if arr.dtype != FILE_DTYPES[dtype]:  # the stored dtype, never a reader's cast
            raise TypeError(f"{self.path}: tensor {key!r} is stored as {dtype} but was read as {arr.dtype}")
        return arr

    def get_buffer(self, key: str) -> np.ndarray:
        """A buffer (a mask, RoPE's frequencies) in its stored dtype: a weight's dtypes, or a bool or uint8 mask
        (GPT-2's causal mask was stored as either); anything else is a ValueError naming it."""
        if key in self.keys and self._handle.get_slice(key).get_dtype() in BUFFER_DTYPES:
            return self._handle.get_tensor(key)
        return self.get(key)


@contextmanager
def open_weight_file(path) -> Iterator[WeightFile]:
    """Open a safetensors file (lazily: nothing but its header is read here)."""
    from safetensors import safe_open

    path = file_path(path)
    if os.path.isdir(path):
        raise IsADirectoryError(_directory_message(path))
    if (problem := path_problem(path)) is not None:
        raise path_error(path, problem, "no such weight file")
    try:
        handle = safe_open(path, framework="numpy")
    except OSError as e:
        raise type(e)(f"{path}: {e}") from e
    except Exception as e:  # safetensors raises its own error type on anything that is not safetensors
        raise ValueError(_not_safetensors_message(path, e)) from e
    with handle as f:
        yield WeightFile(path, dict(f.metadata() or {}), frozenset(f.keys()), f)


def _read_bf16(path: str, key: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return tensor_to_numpy(f.get_tensor(key))


def _directory_message(path: str) -> str:
    names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        return f"{path} is a directory holding no .safetensors file; pass the path of a .safetensors file"
    shown = names if len(names) <= 4 else [*names[:4], f"... {len(names) - 4} more"]
    index = " (its model.safetensors.index.json says which shard holds each tensor)" if "model.safetensors.index.json" in os.listdir(path) else ""
    hf = ("; a transformers checkpoint directory (config.json and its weights) is read whole by "
          "parity.convert.read_checkpoint") if "config.json" in os.listdir(path) else ""
    return f"{path} is a directory, not a safetensors file; pass one of the files in it: {shown}{index}{hf}"


def _not_safetensors_message(path: str, error: Exception) -> str:
    """Why `path` did not open: a pickle, a truncated file, or safetensors' own reason."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
    never = "weight files are safetensors and a pickle is never loaded here (where you trust its source, re-save it with safetensors)"
    if head.startswith(b"PK\x03\x04"):
        return f"{path} is a zip archive -- PyTorch's pickle checkpoint format -- not a safetensors file; {never}"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # pickle's PROTO opcode and protocol number
        return f"{path} is a Python pickle (protocol {head[1]}), not a safetensors file; {never}"
    if size < 8:
        return f"{path} holds {size} bytes, too few for a safetensors file (an 8-byte header length comes first): truncated?"
    header_len = int.from_bytes(head, "little")
    if 8 + header_len > size:
        return (f"{path} is truncated or not a safetensors file: its first 8 bytes announce a {header_len}-byte header, "
                f"but the file holds {size} bytes")
    try:
        with open(path, "rb") as fh:
            fh.seek(8)
            header = parse_json(fh.read(header_len), path)
        data_len = max((entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path} is not a readable safetensors file (its header is not safetensors' JSON): {error}"
    if 8 + header_len + data_len > size:
        return (f"{path} is truncated: its header describes {data_len} bytes of tensor data, "
                f"the file holds {size - 8 - header_len}")
    return f"{path} is not a readable safetensors file: {error}"

"""The files every tool reads and writes: one JSON reader, one atomic writer.

Framework-free (like the rest of mha_spec), so `mha_jax` (its kernel table, `mha_jax.tune`)
and `parity` (reports, checkpoints, bench files) share them without crossing the wall
between frameworks.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any


class JSONFileError(ValueError):
    """A file (or text) that is not readable JSON; the message is one line naming the source."""


def parse_json(text: str | bytes, source: str) -> Any:
    """Parse JSON text; JSONFileError naming `source` for anything Python's reader rejects.

    Besides a syntax error: bytes that are not UTF-8, nesting deeper than the reader's
    recursion allows (RecursionError), an integer too long to convert (ValueError).
    NaN and Infinity literals are accepted, as json.loads does: a caller that needs finite
    numbers checks its own fields.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONFileError(f"{source}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JSONFileError(f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise JSONFileError(f"{source}: JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more digits than int() converts
        raise JSONFileError(f"{source}: not readable JSON ({str(e).splitlines()[0][:200]})") from None


def read_json(path) -> Any:
    """The parsed JSON of the file at `path`.

    FileNotFoundError when there is no such file (callers decide whether that is an error);
    JSONFileError (a ValueError) naming the path for a file that cannot be read (a directory,
    no permission) or is not readable JSON (see `parse_json`).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise JSONFileError(f"{path}: cannot read: {e.strerror or e}") from None
    return parse_json(data, path)


def _umask_mode() -> int:
    """The mode a plain open() would give a new file (mkstemp's own is 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def atomic_path(path, suffix: str = ".tmp"):
    """Yield a temporary path beside `path`; when the block succeeds, rename it over `path`.

    The suffix lets writers that pick a format from the name (matplotlib) see the right one.
    On an exception (Ctrl-C included) the temporary file is removed and `path` is untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to `path` atomically."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(data)
        else:
            with open(tmp, "wb") as f:
                f.write(data)


def writable_problem(path) -> str | None:
    """Why writing `path` with `atomic_path` would fail, or None: checked before a long run.

    atomic_path creates missing directories, so the nearest existing ancestor must be a
    directory where a file can be created: tried for real (and removed), since permission
    bits do not tell root about read-only mounts or /proc; the path must not be a directory.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path):
        return "is a directory"
    existing = os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".tmp-probe-")
    except OSError as e:
        return f"cannot create a file in {existing}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


def check_writable(path) -> None:
    """`writable_problem` as a ValueError naming the path (for callers that raise)."""
    problem = writable_problem(path)
    if problem:
        raise ValueError(f"cannot write {os.fspath(path)}: {problem}")

"""The files every tool reads and writes: one JSON reader, one atomic writer.

Framework-free (like the rest of mha_spec), so `mha_jax` (its kernel table, `mha_jax.tune`)
and `parity` (reports, checkpoints, bench files) share them without crossing the wall
between frameworks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
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


def _is_stream(mode: int) -> bool:
    """A node that is written into, never replaced: a character or block device, a FIFO."""
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)


def _through_process_fd(path: str) -> bool:
    """Whether a link on the way from `path` is one of /proc's file-descriptor links
    (/dev/stdout, /dev/fd/1, /proc/self/fd/1): its target is an open file of a process,
    written into as the shell's `>` would have it, not a path to rename over."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if not os.path.islink(p):
            return False
        directory = os.path.realpath(os.path.dirname(p))
        if directory == "/proc" or directory.startswith("/proc/"):
            return True
        p = os.path.join(directory, os.readlink(p))
    return False


def write_target(path) -> tuple[str, bool]:
    """Where a write of `path` lands, and whether it is written into in place (True) or
    replaced atomically (False).

    A character or block device, a FIFO, or a file a process holds open (/dev/stdout): written
    into, through `path` itself (open() follows every link, /proc's included). Otherwise symbolic
    links are followed to the final target (a dangling one to the file it names), which is
    replaced, so a link stays a link. OSError naming `path` for a loop of symbolic links, a
    directory or a socket: none of them can hold a report.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (yet): created, or refused, on writing
        st = None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a loop of symbolic links", path) from None
        raise
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    if st is not None and stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EINVAL, "is a socket, not a file", path)
    if st is not None and (_is_stream(st.st_mode) or _through_process_fd(path)):
        return path, True
    return os.path.realpath(path), False


def write_into(path, data: bytes) -> None:
    """Write `data` into an existing node as it is: opened for writing (appending, which a
    device or FIFO ignores and which keeps what a process already wrote to its open file),
    never created, replaced or chmod-ed. A failed write (ENOSPC from a full device) raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOCTTY", 0))  # no O_CREAT: it exists
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            if not written:  # a device that takes nothing: never loop on it
                raise OSError(errno.EIO, "the device took none of the bytes", os.fspath(path))
            view = view[written:]
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path, suffix: str = ".tmp"):
    """Yield a temporary path to write; when the block succeeds, its bytes become `path`'s.

    A regular file or a new path: the temporary file sits beside it and is renamed over it
    (atomic: a reader never sees half a file). A symbolic link: the same for its final
    target, and the link stays. A character or block device, a FIFO or a process's open file
    (/dev/stdout): the temporary file is made in the temporary directory and its bytes are
    written into the node (`write_into`), which is never replaced. The suffix lets writers that pick a format from the name
    (matplotlib) see the right one. On an exception (Ctrl-C included) the temporary file is
    removed and `path` is untouched. OSError for what cannot be written (see `write_target`).
    """
    target, stream = write_target(path)
    directory = None if stream else os.path.dirname(target)
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        if stream:
            with open(tmp, "rb") as f:
                write_into(target, f.read())
        else:
            os.chmod(tmp, _umask_mode())
            os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_atomic(path, data: str | bytes) -> None:
    """Write text (UTF-8) or bytes to `path` through `atomic_path` (a device or FIFO directly)."""
    data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    target, stream = write_target(path)
    if stream:
        write_into(target, data)
        return
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def writable_problem(path) -> str | None:
    """Why writing `path` with `atomic_path` would fail, or None: checked before a long run.

    What is written into (a device, a FIFO, /dev/stdout) must grant write permission; it is
    not opened (a FIFO's open waits for a reader, a device's may act). Otherwise atomic_path creates missing directories, so the
    nearest existing ancestor of the (symbolic links followed) target must be a directory
    where a file can be created: tried for real (and removed), since permission bits do not
    tell root about read-only mounts or /proc.
    """
    try:
        target, stream = write_target(path)
    except OSError as e:
        return e.strerror or str(e)  # without the path: the caller names it
    if stream:
        return None if os.access(target, os.W_OK) else "no permission to write into it"
    existing = os.path.dirname(target)
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

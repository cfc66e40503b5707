"""Where a report goes: every writer of mha-parity and mha-bench goes through mha_spec.files.

A regular file is replaced atomically; a symbolic link keeps being a link (its target is
written); a character device or a FIFO is written into and never replaced, and a full
device's ENOSPC is the documented write failure of each CLI. The devices are made here with
mknod (1,3: a null device, 1,7: a full device), never the machine's /dev; where mknod is not
allowed a FIFO stands in for the null device and the full-device tests cannot run.
"""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import stat
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from mha_spec.files import atomic_path, check_writable, writable_problem, write_atomic

NULL, FULL = (1, 3), (1, 7)


def _device(path: Path, numbers) -> bool:
    """A character device at `path` that this process may open for writing; False if not allowed here."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*numbers))
        os.close(os.open(path, os.O_WRONLY))  # a devices cgroup may allow mknod but refuse the open
        return True
    except OSError:
        if os.path.lexists(path):
            os.unlink(path)
        return False


def full_device(path: Path) -> Path:
    if not _device(path, FULL):
        pytest.skip("mknod of a character device is not allowed here: no full device to write into")
    return path


@contextmanager
def fifo_reader(path: Path):
    """A FIFO at `path` whose reader collects what is written; yields the list it appends the bytes to."""
    os.mkfifo(path)
    got: list[bytes] = []

    def read():
        with open(path, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield got
    finally:
        try:  # a writer that never came: release the reader blocked in open()
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        reader.join(10)


def _is_char(path: Path, numbers) -> bool:
    st = os.lstat(path)
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == numbers


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".tmp")]


# ---------------------------------------------------------------- mha_spec.files


def test_a_device_is_written_into_and_never_replaced(tmp_path):
    null = tmp_path / "null"
    if not _device(null, NULL):
        pytest.skip("mknod of a character device is not allowed here")
    full = full_device(tmp_path / "full")
    assert writable_problem(null) is None and writable_problem(full) is None
    write_atomic(null, "report\n")
    with atomic_path(null, suffix=".png") as tmp:  # matplotlib's way: a temporary file, then its bytes
        Path(tmp).write_bytes(b"png")
    assert _is_char(null, NULL)
    with pytest.raises(OSError) as e:
        write_atomic(full, b"x" * 10)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as e, atomic_path(full, suffix=".png") as tmp:
        Path(tmp).write_bytes(b"png")
    assert e.value.errno == errno.ENOSPC and not os.path.exists(tmp)
    assert _is_char(full, FULL) and _leftovers(tmp_path) == []


def test_a_fifo_gets_the_bytes_and_stays_a_fifo(tmp_path):
    lonely = tmp_path / "no-reader"
    os.mkfifo(lonely)
    finished = []
    probe = threading.Thread(target=lambda: finished.append(writable_problem(lonely)), daemon=True)
    probe.start()
    probe.join(10)
    if not finished:  # it opened the FIFO and waits for a reader: be one, so the thread ends
        os.close(os.open(lonely, os.O_RDONLY | os.O_NONBLOCK))
    assert finished == [None], "the preflight must not open a FIFO (without a reader, that waits)"
    fifo = tmp_path / "pipe"
    with fifo_reader(fifo) as got:
        write_atomic(fifo, "héllo\n")
    assert got == ["héllo\n".encode()] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with fifo_reader(tmp_path / "pipe2") as got, atomic_path(tmp_path / "pipe2", suffix=".png") as tmp:
        Path(tmp).write_bytes(b"\x89PNG...")
    assert got == [b"\x89PNG..."] and stat.S_ISFIFO(os.lstat(tmp_path / "pipe2").st_mode)
    assert _leftovers(tmp_path) == []


def test_a_processes_open_file_is_written_into(tmp_path):
    """/dev/stdout's kind of link (here a link to /proc/self/fd/N, never /dev itself): a pipe
    gets the bytes, a file the shell's `>` opened keeps what was printed and gets the report after it."""
    r, w = os.pipe()
    out = open(tmp_path / "out.md", "w")
    try:
        out.write("the table\n")
        out.flush()
        stdout = tmp_path / "stdout"
        stdout.symlink_to(f"/proc/self/fd/{out.fileno()}")
        assert writable_problem(stdout) is None and writable_problem(f"/proc/self/fd/{w}") is None
        write_atomic(stdout, "the report\n")
        write_atomic(f"/proc/self/fd/{w}", b"piped")
        assert os.read(r, 100) == b"piped"
        assert (tmp_path / "out.md").read_text() == "the table\nthe report\n"
        assert os.fstat(out.fileno()).st_nlink == 1 and stdout.is_symlink()  # the open file is the file
    finally:
        out.close()
        os.close(r)
        os.close(w)


def test_a_symbolic_link_stays_a_link_and_its_target_is_written(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "r.json").write_text("old")
    link = tmp_path / "r.json"
    link.symlink_to("real/r.json")  # relative, as `ln -s` makes them
    chain = tmp_path / "chain.json"
    chain.symlink_to("r.json")  # a link to a link: followed to the end
    assert writable_problem(chain) is None
    write_atomic(chain, "new")
    assert chain.is_symlink() and link.is_symlink() and (tmp_path / "real" / "r.json").read_text() == "new"
    dangling = tmp_path / "later.json"
    dangling.symlink_to("real/later.json")
    with atomic_path(dangling, suffix=".png") as tmp:
        Path(tmp).write_text("made")
    assert dangling.is_symlink() and (tmp_path / "real" / "later.json").read_text() == "made"
    assert _leftovers(tmp_path) == [] and _leftovers(tmp_path / "real") == []


def test_what_cannot_hold_a_report_is_refused_by_name(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop")
    (tmp_path / "dir").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        assert writable_problem(loop) == "a loop of symbolic links"
        assert writable_problem(tmp_path / "dir") == "is a directory"
        assert writable_problem(tmp_path / "sock") == "is a socket, not a file"
        with pytest.raises(ValueError, match=f"cannot write {loop}: a loop of symbolic links"):
            check_writable(loop)
        for path in (loop, tmp_path / "dir", tmp_path / "sock"):
            with pytest.raises(OSError, match=str(path)):
                write_atomic(path, "x")
        assert loop.is_symlink() and (tmp_path / "dir").is_dir() and stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
    finally:
        sock.close()
    assert _leftovers(tmp_path) == []


# ---------------------------------------------------------------- the CLIs, end to end


def test_mha_parity_reports_into_a_fifo_a_link_and_a_full_device(tmp_path, capsys):
    """--json into a FIFO, --markdown through a symbolic link, --plot into a full device: exit 1
    (a report could not be written), the other two written, nothing replaced."""
    from parity.cli import main

    full = full_device(tmp_path / "full")
    (tmp_path / "reports").mkdir()
    link = tmp_path / "r.md"
    link.symlink_to("reports/r.md")
    with fifo_reader(tmp_path / "r.json") as got:
        code = main(["--device", "cpu", "--no-progress", "--quick", "--checks", "forward", "--impls", "torch",
                     "--dtypes", "float32", "--json", str(tmp_path / "r.json"), "--markdown", str(link),
                     "--plot", str(full)])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 1, out
    assert f"could not write {full}: No space left on device" in out
    assert json.loads(got[0])["summary"]["pass"] > 0 and stat.S_ISFIFO(os.lstat(tmp_path / "r.json").st_mode)
    assert link.is_symlink() and "| torch |" in (tmp_path / "reports" / "r.md").read_text()
    assert _is_char(full, FULL) and _leftovers(tmp_path) == []


def _bench_console():
    return Console(file=io.StringIO(), width=200)


def test_mha_bench_run_and_report_into_a_fifo_a_link_and_a_full_device(tmp_path):
    """A run (fake workers): --json into a FIFO, --markdown through a link: exit 0, both written,
    neither replaced. `report` of that run, --markdown into a full device: exit 3. (The plot
    goes through the same atomic_path as mha-parity's, tested above; a bench plot costs 2 s.)"""
    from test_bench_cli import FAST, fake_spawn

    from parity.bench import cli

    full = full_device(tmp_path / "full")
    link = tmp_path / "b.md"
    link.symlink_to("target.md")
    with fifo_reader(tmp_path / "b.json") as got:
        console = _bench_console()
        rc = cli.main([*FAST, "--json", str(tmp_path / "b.json"), "--markdown", str(link)],
                      console=console, spawn=fake_spawn([]))
    assert rc == 0, console.file.getvalue()
    assert len(json.loads(got[0])["rows"]) == 4 and stat.S_ISFIFO(os.lstat(tmp_path / "b.json").st_mode)
    assert link.is_symlink() and (tmp_path / "target.md").read_text().startswith("# mha-bench results")

    (tmp_path / "run.json").write_bytes(got[0])
    console = _bench_console()
    rc = cli.main(["report", str(tmp_path / "run.json"), "--markdown", str(full)], console=console)
    text = console.file.getvalue()
    assert rc == 3, text
    assert f"could not write --markdown {full}: OSError: [Errno 28] No space left on device" in text
    assert _is_char(full, FULL) and _leftovers(tmp_path) == []


def test_mha_bench_sharded_report_into_a_full_device_exits_3(tmp_path, monkeypatch):
    from parity.bench import cli, sharded

    def one_row(**kw):  # what a measurement yields, without starting one
        yield dict(framework="jax", layout="sp", devices=1, per_device_peak_bytes=2**20, time_s=0.01, mem_source="x")

    monkeypatch.setattr(sharded, "iter_bench_sharded", one_row)
    full = full_device(tmp_path / "full")
    with fifo_reader(tmp_path / "s.md") as got:
        console = _bench_console()
        rc = cli.main(["sharded", "--shards", "1", "--shardings", "sp", "--frameworks", "jax", "--seq", "8",
                       "--json", str(full), "--markdown", str(tmp_path / "s.md")], console=console)
    text = console.file.getvalue()
    assert rc == 3, text
    assert f"could not write --json {full}: No space left on device" in " ".join(text.split())
    assert b"| jax | sp | 1 |" in got[0] and stat.S_ISFIFO(os.lstat(tmp_path / "s.md").st_mode)
    assert _is_char(full, FULL) and _leftovers(tmp_path) == []

"""The writer's replace killed at every step: the destination holds the old checkpoint complete or the new one
complete, and the next write leaves nothing beside it.

Each case forks a child that replaces an old checkpoint through ``atomic_folder`` (the shards through the real
``ShardWriter``) and SIGKILLs itself just before its k-th file-system call (every rename, exchange, mkdir, unlink,
rmdir, fsync, file opened for writing, file copy and safetensors shard write counts), for every k of the replace.
The parent then compares the destination with both checkpoints byte for byte (an independent snapshot: file
names and contents), and runs the next write.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from mxlib.checkpoints.files import atomic_write, safetensors_io
from mxlib.checkpoints.files.atomic_write import WRITE_MARKER, atomic_folder, is_mxlib_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _write(dest: Path, value: float, overwrite: bool = False) -> None:
    """A small checkpoint: two shards, the index and a config.json, all through the real writer."""
    with atomic_folder(dest, overwrite=overwrite) as tmp:
        w = safetensors_io.ShardWriter(tmp, shard_bytes=64)
        w.add("a", torch.full((8,), value))
        w.add("b", torch.full((8,), value + 1))
        w.close()
        (tmp / "config.json").write_text(f'{{"value": {value}}}')


def _snapshot(folder: Path) -> dict[str, bytes] | None:
    if not folder.is_dir():
        return None
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != WRITE_MARKER}


class _Kill(Exception):
    pass


def _patched(counter: dict, kill_at: int | None):
    """Wrap every file-system call the replace makes: count it, SIGKILL before call number ``kill_at``."""

    def wrap(fn):
        def inner(*args, **kwargs):
            counter["n"] += 1
            if kill_at is not None and counter["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return inner

    real_open = io.open

    def opener(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            return wrap(real_open)(file, mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    patches = [(os, n) for n in ("rename", "replace", "mkdir", "unlink", "rmdir", "fsync")]
    patches += [(shutil, "copyfile"), (atomic_write, "_exchange"), (safetensors_io, "save_file")]
    for mod, name in patches:
        setattr(mod, name, wrap(getattr(mod, name)))
    io.open = builtins.open = opener


def _child(dest: Path, kill_at: int | None, count_file: Path, exchange: bool) -> None:
    """In a forked child: the replace, killed before call ``kill_at``; never returns."""
    code = 0
    try:
        if not exchange:
            atomic_write._exchange = lambda a, b: False  # the two-rename replace of file systems without it
        counter = {"n": 0}
        _patched(counter, kill_at)
        _write(dest, 2.0)
        count_file.write_bytes(str(counter["n"]).encode())
    except BaseException as err:  # noqa: BLE001  reported through the exit code
        sys.stderr.write(f"child failed: {err!r}\n")
        code = 3
    finally:
        os._exit(code)


def _run_child(dest: Path, kill_at: int | None, count_file: Path, exchange: bool) -> int:
    pid = os.fork()
    if pid == 0:
        _child(dest, kill_at, count_file, exchange)
    _, status = os.waitpid(pid, 0)  # reaped: its PID is no longer a running process
    return status


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_replace_killed_at_every_step(tmp_path, exchange):
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    _write(old_dir, 1.0)
    _write(new_dir, 2.0)
    old, new = _snapshot(old_dir), _snapshot(new_dir)
    assert old != new and is_mxlib_checkpoint(old_dir)

    work = tmp_path / "work"
    work.mkdir()
    dest, count_file = work / "ckpt", tmp_path / "count"
    shutil.copytree(old_dir, dest)
    status = _run_child(dest, None, count_file, exchange)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    steps = int(count_file.read_text())
    assert _snapshot(dest) == new
    assert steps >= 12, steps  # markers, shards, index, config, fsyncs, the replace, the removal

    seen = {"old": 0, "new": 0, "restored": 0}
    for k in range(1, steps + 1):
        shutil.rmtree(work)
        work.mkdir()
        shutil.copytree(old_dir, dest)
        status = _run_child(dest, k, count_file, exchange)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, status)
        now = _snapshot(dest)
        if now is None:  # only between the two renames: the old checkpoint is whole in a marked temporary
            assert not exchange, f"step {k}: no destination after a crash"
            assert atomic_write.recover_interrupted(dest) == dest, f"step {k}"
            now = _snapshot(dest)
            seen["restored"] += 1
        assert now in (old, new), f"step {k}: the destination is neither checkpoint: {sorted(now)}"
        assert is_mxlib_checkpoint(dest), f"step {k}"
        seen["old" if now == old else "new"] += 1
        # the next write: replaces whichever is there and leaves nothing of the killed write beside it
        _write(dest, 3.0)
        leftovers = sorted(p.name for p in work.iterdir())
        assert leftovers == ["ckpt"], f"step {k}: {leftovers}"
        assert _snapshot(dest)["config.json"] == b'{"value": 3.0}'
    assert seen["old"] > 0 and seen["new"] > 0, seen
    assert (seen["restored"] > 0) == (not exchange), seen


def test_replace_renames_nothing_of_the_old_checkpoint(tmp_path, monkeypatch):
    """The removability check reads ``stat`` only: the old checkpoint's entries are never renamed away and
    back (the one rename that touches it is the exchange)."""
    dest = tmp_path / "ckpt"
    _write(dest, 1.0)
    renamed = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b, **kw: (renamed.append((Path(a), Path(b))), real(a, b, **kw))[1])
    _write(dest, 2.0)
    assert not [a for a, _ in renamed if dest in a.parents], renamed


def test_immutable_old_checkpoint_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """An entry with the immutable flag (``chattr +i``; simulated: setting it needs root) fails the write
    with a PermissionError naming the destination, the old checkpoint as it was and nothing beside it."""
    dest = tmp_path / "ckpt"
    _write(dest, 1.0)
    before = _snapshot(dest)
    frozen = dest / "config.json"
    real = atomic_write._inode_flags
    monkeypatch.setattr(atomic_write, "_inode_flags", lambda p: 0x10 if Path(p) == frozen else real(p))
    with pytest.raises(PermissionError, match=r"ckpt.*config\.json is immutable"):
        _write(dest, 2.0)
    assert _snapshot(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_unwritable_old_folder_is_refused_before_anything_changes(tmp_path, monkeypatch):
    """A folder this process cannot write (its entries cannot be removed; simulated through ``os.access``,
    which root passes whatever the mode)."""
    dest = tmp_path / "ckpt"
    _write(dest, 1.0)
    before = _snapshot(dest)
    real = os.access
    monkeypatch.setattr(atomic_write.os, "access", lambda p, mode: False if Path(p) == dest else real(p, mode))
    with pytest.raises(PermissionError, match="cannot write"):
        _write(dest, 2.0)
    assert _snapshot(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_temporary_killed_while_being_made_is_removed(tmp_path):
    """An empty ``.<name>.tmp-<pid>-<hex>`` (killed between the mkdir and the marker) of a process that is
    gone is removed by the next write; one of a live process, or one holding a user's file, is kept."""
    dest = tmp_path / "ckpt"
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    dead = tmp_path / f".ckpt.tmp-{pid}-0123abcd"
    dead.mkdir()
    live = tmp_path / f".ckpt.tmp-{os.getpid()}-0123abcd"
    live.mkdir()
    users = tmp_path / f".ckpt.tmp-{pid}-89abcdef"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    _write(dest, 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", live.name, users.name])

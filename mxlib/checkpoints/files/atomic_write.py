"""The atomic folder write every checkpoint writer goes through (``atomic_folder``), and its crash points.

A checkpoint is written into a temporary folder ``.<name>.tmp-<pid>-<hex>`` beside the destination, which
holds a marker file (``WRITE_MARKER``: the writer's PID, its process start time and host), and is renamed into
place only when complete. The promise at every instant, a crash or a ``SIGKILL`` included: the destination
holds the old checkpoint complete or the new one complete, never a mix, and nothing of the old one is renamed.

The steps of a replace, and what a crash after each leaves (``tests/test_crash_points.py`` kills a writer at
every file-system call of a replace and checks this):

1. the destination checked (absent, an empty folder, an earlier mxlib checkpoint: a folder with
   ``CHECKPOINT_MARKER`` and only the files it lists; anything else needs ``overwrite=True``);
2. stale temporaries of this destination removed (below);
3. the temporary folder made and its marker written; the caller writes its files; ``CHECKPOINT_MARKER``
   written; every file and the folder flushed to disk (``fsync``) -- a crash: the old checkpoint untouched,
   the temporary left;
4. the old checkpoint checked to be removable, from ``stat`` only (nothing renamed): its folders writable by
   this process, no immutable or append-only entry (``FS_IOC_GETFLAGS``), no sticky folder holding another
   user's entry. A ``PermissionError`` naming it ends the write here, the old checkpoint as it was;
5. a copy of the write marker put into the old folder (a file the checkpoint check ignores), so that the old
   folder, once it sits at the temporary name, is found and removed by the next write;
6. one ``renameat2(RENAME_EXCHANGE)`` (Linux): the new folder at the destination, the old at the temporary
   name, in one step -- before it the old checkpoint is complete, after it the new one;
7. the old folder removed, its marker last (a crash midway leaves a marked folder the next write removes), and
   the parent folder flushed.

Where ``RENAME_EXCHANGE`` is missing (not Linux, or a file system without it) step 6 is two renames: the old
folder into ``.<name>.tmp-<pid>-<hex>/old``, then the new into place. A crash between the two leaves no
destination and the old checkpoint complete inside the marked temporary; the next write to the destination
(or ``recover_interrupted(path)``) moves it back before anything else.

Stale temporaries are **removed** by the next write to the same destination: every ``.<name>.tmp-*`` folder
whose marker names a process of this host that is no longer running (PID and start time), and every empty
``.<name>.tmp-<pid>-<hex>`` folder (a writer killed between making it and writing its marker) whose PID is
not running. Folders without the marker that hold anything, of another host, or of a live process are never
touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import struct
import time
import uuid
from pathlib import Path

__all__ = [
    "CHECKPOINT_MARKER",
    "WRITE_MARKER",
    "WRITER_VERSION",
    "atomic_folder",
    "describe_destination",
    "is_mxlib_checkpoint",
    "recover_interrupted",
]

# Bump when what the writer stores changes (part of the checkpoint cache key).
WRITER_VERSION = 3
CHECKPOINT_MARKER = "mxlib_checkpoint.json"
WRITE_MARKER = ".mxlib-write.json"
_OLD = "old"  # the old folder inside a temporary, where renameat2(RENAME_EXCHANGE) is missing
_TMP_PID = re.compile(r"\.tmp-(\d+)-[0-9a-f]+$")


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``), to tell a reused PID apart; None elsewhere."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _stale(p: Path) -> bool:
    """Whether a ``.<name>.tmp-*`` folder was left by an mxlib write of this host that is no longer running."""
    if p.is_symlink() or not p.is_dir():
        return False
    marker = p / WRITE_MARKER
    try:
        m = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, ValueError):
        m = None
    if isinstance(m, dict) and m.get("writer") == "mxlib":
        try:
            return m.get("host") == socket.gethostname() and not _alive(int(m["pid"]), m.get("start"))
        except (KeyError, TypeError, ValueError):
            return False
    # no readable marker: only a folder killed while being made (empty, or its marker half written)
    found = _TMP_PID.search(p.name)
    try:
        entries = [q.name for q in p.iterdir()]
    except OSError:
        return False
    return found is not None and set(entries) <= {WRITE_MARKER} and not _alive(int(found[1]), None)


def _remove_marked(folder: Path) -> None:
    """Remove ``folder`` with its write marker last, so that a crash midway leaves a folder still marked."""
    for p in folder.iterdir():
        if p.name == WRITE_MARKER:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    (folder / WRITE_MARKER).unlink(missing_ok=True)
    folder.rmdir()


def recover_interrupted(path: str | os.PathLike) -> Path | None:
    """Where the destination ``path`` is absent and a stale temporary beside it holds the old destination
    (a two-rename replace killed between its renames), move it back to ``path``.
    Returns the restored path, or None."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        return None
    for p in sorted(path.parent.glob(f".{path.name}.tmp-*")):
        if _stale(p) and (p / _OLD).exists():
            os.rename(p / _OLD, path)
            (path / WRITE_MARKER).unlink(missing_ok=True)
            return path
    return None


def _remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the stale ``.<name>.tmp-*`` folders beside ``path`` (module docstring). Returns them."""
    removed = []
    for p in path.parent.glob(f".{path.name}.tmp-*"):
        if _stale(p):
            try:
                _remove_marked(p)
            except OSError:
                continue
            removed.append(p)
    return removed


def is_mxlib_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a folder that an mxlib writer made and nobody added to: it holds
    ``CHECKPOINT_MARKER`` and only the files that marker lists."""
    path = Path(path)
    marker = path / CHECKPOINT_MARKER
    if path.is_symlink() or not path.is_dir() or not marker.is_file():
        return False
    try:
        if marker.stat().st_size > 1 << 20:
            return False
        files = set(json.loads(marker.read_text())["files"])
        entries = {p.name for p in path.iterdir()} - {WRITE_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return entries <= files | {CHECKPOINT_MARKER} and all(
        (path / f).is_file() and not (path / f).is_symlink() for f in entries
    )


def describe_destination(path: Path) -> str:
    """What an existing destination is, in words, for a refusal: ``a file``, ``a FIFO``, ``a folder that is not
    an mxlib checkpoint``, or ``a symbolic link to TARGET (an mxlib checkpoint)`` (a link is described by what it
    points to: a checkpoint, a folder, a file, or nothing)."""
    if path.is_symlink():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        if not path.exists():
            what = "nothing: a dangling link"
        else:
            what = describe_destination(path.resolve())
        return (
            f"a symbolic link to {target} ({what}; overwrite=True replaces the link itself, not its target: "
            f"to replace the target, write to its own path)"
        )
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "an entry that cannot be read"
    if stat.S_ISDIR(mode):
        return "an mxlib checkpoint" if is_mxlib_checkpoint(path) else "a folder that is not an mxlib checkpoint"
    if stat.S_ISREG(mode):
        return "a file"
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _check_destination(path: Path, overwrite: bool) -> None:
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return
    if overwrite or is_mxlib_checkpoint(path):
        return
    what = describe_destination(path)
    raise FileExistsError(
        f"{path}: the destination is {what} (an mxlib checkpoint holds {CHECKPOINT_MARKER} and only the files "
        f"it lists); refusing to replace it. Choose another path, empty it, or pass overwrite=True to replace it."
    )


_FS_IOC_GETFLAGS = 0x80086601  # linux/fs.h
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20


def _inode_flags(p: Path) -> int:
    """The Linux inode flags of ``p`` (0 where they cannot be read)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return 0
    try:
        buf = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("l", 0))
        return struct.unpack("l", buf)[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def _check_removable(path: Path) -> None:
    """Raise ``PermissionError`` naming ``path`` when its old folder (or file) cannot be removed by this
    process, read from ``stat`` and the inode flags only: nothing is renamed or changed."""

    def refuse(p: Path, why: str):
        raise PermissionError(
            f"{path}: cannot replace the existing checkpoint: {p.relative_to(path.parent)} {why}; nothing was changed"
        )

    euid = os.geteuid() if hasattr(os, "geteuid") else None

    def check_entry(parent: Path, p: Path) -> None:
        st = os.lstat(p)
        if _inode_flags(p) & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
            refuse(p, "is immutable or append-only (chattr)")
        pst = os.stat(parent)
        if euid not in (None, 0) and pst.st_mode & stat.S_ISVTX and euid not in (st.st_uid, pst.st_uid):
            refuse(p, "belongs to another user in a sticky folder")

    parent = path.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        refuse(parent, "is a folder this process cannot write")
    check_entry(parent, path)
    if not path.is_dir() or path.is_symlink():
        return
    for folder, dirs, files in os.walk(path):
        folder = Path(folder)
        if _inode_flags(folder) & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
            refuse(folder, "is immutable or append-only (chattr)")
        if not os.access(folder, os.W_OK | os.X_OK):
            refuse(folder, "is a folder this process cannot write (its entries cannot be removed)")
        for name in dirs + files:
            check_entry(folder, folder / name)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(e, os.strerror(e), str(b))


def _fsync(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system without fsync on folders
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            _fsync(p)
    _fsync(folder)


def _umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _share_files(folder: Path) -> None:
    """Give every regular file of ``folder`` the mode an ordinary new file gets, ``0o666`` less the umask
    (``0644`` under the usual umask 022): safetensors creates its files ``0600``, which a server running as
    another user (vLLM in a container) cannot read."""
    mode = 0o666 & ~_umask()
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def _new_temporary(path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    marker = {
        "writer": "mxlib",
        "pid": os.getpid(),
        "start": _proc_start(os.getpid()),
        "host": socket.gethostname(),
        "time": time.time(),
        "destination": path.name,
    }
    (tmp / WRITE_MARKER).write_text(json.dumps(marker))
    return tmp


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary folder beside ``path``; on success it replaces ``path`` (module docstring:
    which destinations are accepted, the steps and what a crash after each leaves), on any error it is
    removed and ``path`` is left as it was.

    The caller writes its files into the folder; ``CHECKPOINT_MARKER`` listing them is added here, and
    every file is given the mode an ordinary new file gets (``0o666`` less the umask: ``0644`` under umask
    022), whatever mode its writer created it with (safetensors' ``0600``), so that a server running as
    another user can read the checkpoint. The folder itself is made ``0o777`` less the umask.

    Raises:
        FileExistsError: ``path`` is a file or a non-empty folder that is not an mxlib checkpoint, and
            ``overwrite`` is false (checked before anything is written, and again before the replace).
        PermissionError: the existing ``path`` cannot be removed (read-only, immutable); nothing changed.
    """
    path = Path(path)
    _check_destination(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted(path)
    _check_destination(path, overwrite)  # a restored old checkpoint is one
    _remove_stale_temporaries(path)
    tmp = _new_temporary(path)
    try:
        yield tmp
        files = sorted(p.name for p in tmp.iterdir() if p.name != WRITE_MARKER)
        (tmp / CHECKPOINT_MARKER).write_text(
            json.dumps({"writer": "mxlib", "writer_version": WRITER_VERSION, "files": files}, indent=1)
        )
        _share_files(tmp)
        _fsync_tree(tmp)
        _check_destination(path, overwrite)  # again: it may have changed while writing
        if not (path.exists() or path.is_symlink()):
            tmp.rename(path)
            tmp = None
        else:
            _check_removable(path)
            folder = path.is_dir() and not path.is_symlink()
            if folder:
                shutil.copyfile(tmp / WRITE_MARKER, path / WRITE_MARKER)
            if folder and _exchange(tmp, path):
                old, tmp = tmp, None  # the old folder now sits at the temporary name, marked
            else:
                old = _new_temporary(path)
                os.rename(path, old / _OLD)  # the old one, complete, inside a marked temporary
                tmp.rename(path)
                tmp = None
            _remove_marked(old)
        (path / WRITE_MARKER).unlink(missing_ok=True)
        _fsync(path.parent)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

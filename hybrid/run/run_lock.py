"""One run per model directory: a lock file ``LOCK`` in it, naming its holder.

Conceptually::

    open model_dir/LOCK (created if absent) and flock() it, never waiting
      held by a live process here      -> RunLockError naming the holder (host, pid, start)
      acquired, the file names a process of this host (now gone) -> taken over, a warning
      acquired, the file names another host -> RunLockError, unless take_over=True
    write {"host", "pid", "started"} into it; on release: delete it, unlock

``flock`` is released by the kernel when its process dies (SIGKILL included), so a lock of
this host is stale exactly when it can be acquired; a lock written on another host cannot be
probed from here (``flock`` does not cross NFS reliably), so it is honoured unless the user
says that run is gone. Object-store directories (``gs://``) cannot hold a lock: none is taken.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable
from types import TracebackType

__all__ = ["LOCK_FILE", "RunLock", "RunLockError", "release_all"]

LOCK_FILE = "LOCK"
_HELD: set[RunLock] = set()  # the locks this process holds now


def release_all() -> None:
    """Releases every lock this process holds: for a process that must end at once
    (``os._exit`` from another thread, which skips the locks' ``with`` blocks)."""
    for lock in list(_HELD):
        lock.release()


class RunLockError(RuntimeError):
    """Another run holds the model directory."""


def _holder(text: str) -> dict[str, object]:
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, object]) -> str:
    if not holder:
        return "a run that left no details"
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"


class RunLock:
    """The lock of ``directory`` for this process, as a context manager.

    Args:
      directory: the model directory (created if absent).
      take_over: take a lock written on another host (that run is known to be gone).
      log: receives the warning when a stale lock is taken over.

    Raises (on entry):
      RunLockError: a live run holds the directory, or one on another host may.
    """

    def __init__(
        self, directory: str, take_over: bool = False, log: Callable[[str], None] = print
    ) -> None:
        self.directory, self.take_over, self.log = directory, take_over, log
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        if "://" in self.directory:
            self.log(f"WARNING {self.directory}: an object store holds no lock; run one job there")
            return self
        os.makedirs(self.directory, exist_ok=True)
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise RunLockError(self._held_message(self._read(), live=True)) from None
            if not os.path.exists(self.path) or os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)  # its holder deleted it as we opened it: try the new file
                continue
            self._fd = fd
            self._claim(self._read())
            _HELD.add(self)
        return self

    def _read(self) -> dict[str, object]:
        try:
            with open(self.path) as f:
                return _holder(f.read())
        except OSError:
            return {}

    def _held_message(self, holder: dict[str, object], live: bool) -> str:
        why = "is in use by" if live else "is locked by"
        fix = (
            "stop that run first, or point --model_dir at another directory"
            if live
            else "if that run is gone, pass --take_over_lock; or point --model_dir at another "
            "directory"
        )
        return f"--model_dir={self.directory} {why} {_describe(holder)}: {self.path}; {fix}"

    def _claim(self, holder: dict[str, object]) -> None:
        """Checks the lock just acquired (stale here, or another host's) and writes ours."""
        assert self._fd is not None
        host = socket.gethostname()
        if holder and holder.get("host") != host and not self.take_over:
            os.close(self._fd)  # the file stays: it is the other host's lock
            self._fd = None
            raise RunLockError(self._held_message(holder, live=False))
        if holder:
            self.log(
                f"WARNING taking over the lock {self.path} of {_describe(holder)}, which is no "
                "longer running"
            )
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = json.dumps({"host": host, "pid": os.getpid(), "started": started})
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, record.encode(), 0)
        os.fsync(self._fd)

    def release(self) -> None:
        """Deletes the lock file and unlocks it (a no-op when not held)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing the last descriptor releases the flock
        self._fd = None
        _HELD.discard(self)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

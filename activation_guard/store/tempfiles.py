"""Temporary files for atomic golden writes, and the cleanup of ones an interrupted write left.

A golden is written to ``.<name>.<random>.h-<host>.ag-tmp.<pid>`` next to its target and renamed
over it only once complete, so readers never see half a golden. The name is hidden, has no
``.h5`` suffix (never mistaken for a golden) and says who wrote it: a later writer removes the
file when that process is dead. The host tag matters on shared folders (NFS, container volumes):
a pid means nothing on another machine, so another host's temp file is removed only when old.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile
import time

TMP_MARK = ".ag-tmp."
STALE_FOREIGN_SECONDS = 24 * 3600  # another host's temp file is removed only when this old


def host_tag() -> str:
    """This machine's name, reduced to [A-Za-z0-9-], as temp file names carry it."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def tmp_name_re(base: str) -> re.Pattern[str]:
    """Matches the temp files of the golden named ``base``; groups: host tag (None in names
    written before the tag existed) and pid."""
    return re.compile(re.escape(f".{base}.") + r".*?(?:\.h-([A-Za-z0-9-]+))?" + re.escape(TMP_MARK) + r"(\d+)$")


def create_temp(path: str) -> str:
    """Create an empty temp file for ``path`` in its folder (so the final rename is atomic);
    raises OSError when the folder cannot be made or written."""
    d = os.path.dirname(path)
    base = os.path.basename(path)
    os.makedirs(d, exist_ok=True)
    cleanup_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=f".h-{host_tag()}{TMP_MARK}{os.getpid()}", dir=d)
    os.close(fd)
    return tmp


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a pid we may not signal counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_temps(path: str) -> list[str]:
    """Remove temporary files left by interrupted writes of ``path`` (their writer is dead)."""
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    pat = tmp_name_re(base)
    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    me = host_tag()
    for n in names:
        m = pat.match(n)
        if not m:
            continue
        host, pid = m.group(1), int(m.group(2))
        full = os.path.join(d, n)
        if host is None or host == me:
            stale = not pid_alive(pid)
        else:
            try:
                stale = time.time() - os.stat(full).st_mtime > STALE_FOREIGN_SECONDS
            except OSError:
                continue
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(full)
                removed.append(n)
    return removed


def default_mode(path: str) -> int:
    """The permission bits a golden at ``path`` gets: the old file's when it is replaced (a user's
    chmod survives re-recording), else what the umask gives a new file (not mkstemp's 0600)."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask

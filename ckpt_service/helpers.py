"""Small shared helpers (one home each): removing a local tree, and a free local TCP port."""

from __future__ import annotations

import os
import shutil
import socket


def remove_tree(path: str | os.PathLike[str], ignore_errors: bool = True) -> None:
    """Remove a folder with its contents, or a file or symlink (a link is removed, never followed).

    A missing path is fine; other failures are ignored unless `ignore_errors` is false."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=ignore_errors)
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        if not ignore_errors:
            raise


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test server or a gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

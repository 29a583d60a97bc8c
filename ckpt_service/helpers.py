"""Small shared helpers (one home each): removing a local tree, and a free local TCP port."""

from __future__ import annotations

from converters import remove_tree

__all__ = ["free_port", "remove_tree"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test server or a gloo rendezvous)."""
    import socket  # here: the offline commands never open one

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

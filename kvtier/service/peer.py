"""Who may attach to the node service: the socket's directory and the peer's uid.

Two gates, both the kernel's: the socket lives in a directory of mode 0700 owned by the service's
user (nobody else can reach the socket at all), and each peer's uid, read with ``SO_PEERCRED`` when
it connects, must be the service's own. Processes that pass can read and write every page they map:
the gates keep other users out, not one of the user's own processes from another.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass

from kvtier.errors import ConfigError, ServiceAccessError

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connected peer's pid, uid and gid, as the kernel recorded them when it connected."""
    return PeerCredentials(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


def check_peer(peer: PeerCredentials, uid: int) -> None:
    """A peer whose uid is not ``uid`` (the service's) is refused."""
    if peer.uid != uid:
        raise ServiceAccessError(f"process {peer.pid} runs as uid {peer.uid}; this node service admits uid {uid} only")


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvtier/node.sock``, else ``/tmp/kvtier-<uid>/node.sock``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(base, "kvtier") if base else f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(folder, "node.sock")


def private_socket_dir(path: str, uid: int) -> None:
    """Make the socket's directory (mode 0700) if it is missing; refuse one that is not a real directory
    owned by ``uid`` that only it can enter (a directory made in advance by someone else is how a
    socket gets hijacked)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"--socket {path}: cannot make its directory {folder} ({e.strerror}); choose a path in a directory you own")
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise ConfigError(f"--socket {path}: its directory {folder} must be a directory of uid {uid} with mode 0700 (it is uid "
                          f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}{'' if stat.S_ISDIR(st.st_mode) else ', not a directory'}); "
                          "use a fresh directory, or chmod 700 it")


def claim_socket_path(path: str) -> None:
    """Clear the way to bind ``path``: a socket nobody listens on (a service that died) is removed; a live
    one, or anything that is not a socket, is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"--socket {path} exists and is not a socket; choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale: left by a service that was killed
        return
    finally:
        probe.close()
    raise ConfigError(f"--socket {path}: a node service already listens there; stop it first or choose another path")

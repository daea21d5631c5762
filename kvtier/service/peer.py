"""Who may attach to the node service, and which service an engine may attach to: both ends check the other.

The service's two gates, both the kernel's: the socket lives in a directory of mode 0700 owned by the
service's user (nobody else can reach the socket at all), and each peer's uid, read with ``SO_PEERCRED``
when it connects, must be the service's own. With ``--allow-group`` the directory is 0750 and the socket
0660 of that group, and a peer of another uid is admitted when the group is its gid (``SO_PEERCRED``)
or one of its supplementary groups (``/proc/PID/status``). Processes that pass can read and write
every page they map: the gates keep other users out, not one admitted process from another.

The engine's, before it sends a byte (:func:`check_socket_dir`, :func:`check_listener`): the socket's
directory is a real directory of the service's uid -- the engine's own, or the one configured
(``TierConfig.service_uid``) -- that nobody else can write into, so nobody else can have made the
socket in it; and the listener's uid (``SO_PEERCRED`` of the engine's own end) is that uid. What they
establish is a :class:`ServiceTrust`, which the region the service names is checked against before it
is mapped (:func:`kvtier.service.region.check_region_fd`). Without them another user who made
``/tmp/kvtier-<uid>`` first (the default path where ``$XDG_RUNTIME_DIR`` is unset) could listen there,
name a region file of its own, and read every page the engine backs up into it.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
import struct
from dataclasses import dataclass

from kvtier.errors import ConfigError, ServiceAccessError, ServiceError, ServiceUnavailableError

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connected peer's pid, uid and gid, as the kernel recorded them when it connected."""
    return PeerCredentials(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


@dataclass(frozen=True)
class ServiceTrust:
    """The node service an engine attaches to, as the engine checked it: the service's ``uid``, and the
    ``group`` its socket's directory lets in (``--allow-group``: 0750 of that group), if any. A region it
    names must be a file of ``uid`` with no permission bits beyond 0600 -- 0660 when the file's group is
    ``group`` (:func:`kvtier.service.region.check_region_fd`)."""

    uid: int
    group: int | None = None


#: what to do about a service the engine refuses to attach to
_FIX = ("start kvtier serve yourself with --socket in a directory you own (or set XDG_RUNTIME_DIR, whose kvtier/ only you can "
        "reach) and point the engine at it; a service that runs as another user on purpose is named by TierConfig.service_uid "
        "(service_uid in an integration's config)")


def service_uid_of(configured: int | None) -> int:
    """The uid the engine expects the service to run as: ``configured`` (``TierConfig.service_uid``), else its own."""
    return os.getuid() if configured is None else configured


def check_socket_dir(path: str, service_uid: int | None = None) -> ServiceTrust:
    """Before an engine connects to the service at ``path``: the socket's directory must be a directory
    (not a link) of the service's uid (:func:`service_uid_of`) that no other user can write into (no group
    or world write bit), else anyone could have made the socket there -- ``/tmp/kvtier-<uid>`` made in
    advance by another user is how the default path is squatted. A :class:`ServiceAccessError` naming
    the path, the owner found and the fix; a :class:`ServiceError` when it does not exist (no service
    ever listened there). The :class:`ServiceTrust` the rest of the attachment is checked against."""
    uid = service_uid_of(service_uid)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise ServiceUnavailableError(f"no node service listens on {path} (there is no {folder}); start one with kvtier serve") from None
    except OSError as e:
        raise ServiceError(f"cannot look at the node service's socket directory {folder} ({e.strerror or e})") from None
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or mode & 0o022:
        what = ("not a directory" if not stat.S_ISDIR(st.st_mode) else "another user's" if st.st_uid != uid else
                "others may write into it" if mode & 0o002 else "its group may write into it")
        raise ServiceAccessError(f"the node service's socket {path}: its directory {folder} is owned by uid {st.st_uid} with mode "
                                 f"{mode:o} ({what}); an engine attaches only through a directory of uid {uid} that nobody else can "
                                 f"write into (else another user could listen there and read every page it writes): {_FIX}")
    return ServiceTrust(uid, st.st_gid if mode & 0o070 else None)


def check_listener(sock: socket.socket, path: str, trust: ServiceTrust) -> None:
    """The process listening on ``path`` (``sock`` is the engine's connected end) runs as ``trust.uid``
    (``SO_PEERCRED``: the listener's credentials when it called ``listen``); a :class:`ServiceAccessError` otherwise."""
    peer = peer_credentials(sock)
    if peer.uid != trust.uid:
        raise ServiceAccessError(f"the node service at {path} is process {peer.pid} of uid {peer.uid}, not of uid {trust.uid}; an "
                                 f"engine attaches only to a service of its own uid or the one configured: {_FIX}")


def check_peer(peer: PeerCredentials, uid: int, gid: int | None = None) -> None:
    """A peer whose uid is not ``uid`` (the service's) is refused, unless ``gid`` (``--allow-group``) is
    its gid or one of its supplementary groups."""
    if peer.uid == uid:
        return
    if gid is None:
        raise ServiceAccessError(f"process {peer.pid} runs as uid {peer.uid}; this node service admits uid {uid} only")
    if peer.gid == gid:
        return
    groups = supplementary_groups(peer.pid)
    if gid not in groups:
        raise ServiceAccessError(f"process {peer.pid} runs as uid {peer.uid}, gid {peer.gid}, groups {sorted(groups)}; this node "
                                 f"service admits uid {uid} and group {gid} only")


def supplementary_groups(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` now (``Groups:`` of ``/proc/PID/status``); none if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def group_id(group: str) -> int:
    """``--allow-group``'s value: a group name, or a numeric gid (which needs no entry in the group database)."""
    if group.isdigit():
        if int(group) >= (1 << 32) - 1:
            raise ConfigError(f"--allow-group {group}: not a gid (gids are below {(1 << 32) - 1})")
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--allow-group {group}: no such group (getent group lists them); give a group name or a numeric gid") from None


def share_with_group(path: str, gid: int, mode: int, what: str) -> None:
    """Give ``path`` (the service's) to group ``gid`` with ``mode``; a service not in the group may not."""
    try:
        os.chown(path, -1, gid, follow_symlinks=False)
        os.chmod(path, mode)
    except OSError as e:
        raise ConfigError(f"--allow-group {gid}: cannot give {what} {path} to group {gid} ({e.strerror}); a service may share "
                          "only with a group its user is a member of") from None


#: how an integration's option names the service's socket as a URL
UNIX_SCHEME = "unix://"


def service_socket_path(value: object, option: str) -> object:
    """An integration's service option as the socket's absolute path. Two forms are accepted, one way each:
    ``unix:///abs/node.sock`` and a plain absolute path (``~`` or ``~user`` at its start expanded: ``~/node.sock``).
    Anything else -- ``unix:/x`` or ``unix://x`` (a URL whose path is not absolute), a relative path, another
    scheme -- is a :class:`ConfigError` naming ``option`` and the accepted forms (before, ``unix:/x`` was taken
    as a relative path and reported later as "no node service listens"). A value that is not a string is
    returned as it is, for the caller's own check."""
    if not isinstance(value, str):
        return value
    forms = "write unix:///absolute/path.sock, or the plain path: /absolute/path.sock or ~/path.sock (kvtier serve --socket)"
    if value.startswith(UNIX_SCHEME) and value[len(UNIX_SCHEME):].startswith("/"):
        return value[len(UNIX_SCHEME):]
    if value.lower().startswith("unix:"):
        raise ConfigError(f"{option}={value!r} is not a socket URL: after unix:// comes an absolute path (three slashes in all); {forms}")
    if "://" in value:
        raise ConfigError(f"{option}={value!r}: the node service listens on a unix socket, not {value.split('://')[0]}://; {forms}")
    path = os.path.expanduser(value)
    if not path.startswith("/"):
        raise ConfigError(f"{option}={value!r} is not an absolute path (an engine's working directory is not the service's); {forms}")
    return path


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvtier/node.sock``, else ``/tmp/kvtier-<uid>/node.sock``. Anyone may make
    ``/tmp/kvtier-<uid>`` before its user does: the service refuses to listen in it and an engine to
    connect through it unless it is that user's, and nobody else's to write into (:func:`private_socket_dir`,
    :func:`check_socket_dir`), so a squatted one is a typed error naming its owner, never an attachment."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(base, "kvtier") if base else f"/tmp/kvtier-{os.getuid()}"
    return os.path.join(folder, "node.sock")


def private_socket_dir(path: str, uid: int, gid: int | None = None) -> None:
    """Make the socket's directory (mode 0700) if it is missing; refuse one that is not a real directory
    owned by ``uid`` that only it can enter (a directory made in advance by someone else is how a
    socket gets hijacked). ``gid`` (``--allow-group``): the directory, private so far or that group's
    already, becomes 0750 of that group."""
    folder = os.path.dirname(os.path.abspath(path))
    if gid is not None:
        _check_group_reaches(folder, gid, path)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"--socket {path}: cannot make its directory {folder} ({e.strerror}); choose a path in a directory you own")
    st = os.lstat(folder)
    grouped = gid is not None and st.st_gid == gid and not st.st_mode & 0o027
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or (st.st_mode & 0o077 and not grouped):
        wanted = "mode 0700" if gid is None else f"mode 0700, or 0750 of group {gid}"
        raise ConfigError(f"--socket {path}: its directory {folder} must be a directory of uid {uid} with {wanted} (it is uid "
                          f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}{'' if stat.S_ISDIR(st.st_mode) else ', not a directory'}); "
                          "use a fresh directory, or chmod 700 it")
    if gid is not None:
        share_with_group(folder, gid, 0o750, "the socket's directory")


def _check_group_reaches(folder: str, gid: int, path: str) -> None:
    """Every directory above ``folder`` lets group ``gid`` through (search permission for it or for
    everyone): else ``--allow-group`` would admit a group that can never reach the socket."""
    above = os.path.dirname(folder)
    while True:
        st = os.stat(above)
        if not (st.st_mode & 0o001 or (st.st_gid == gid and st.st_mode & 0o010)):
            raise ConfigError(f"--socket {path}: group {gid} (--allow-group) cannot pass through {above} (uid {st.st_uid}, gid "
                              f"{st.st_gid}, mode {stat.S_IMODE(st.st_mode):o}), so its members could never reach the socket; put "
                              "the socket in a directory they can reach (e.g. --socket /run/kvtier/node.sock)")
        if above == os.path.dirname(above):
            return
        above = os.path.dirname(above)


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

"""An engine attaches to the node service: its host allocator leases the service's pages, and its host
pool (where this process holds the bytes) is a view of the service's region.

**Any start order.** A service that does not answer yet (:class:`~kvtier.errors.ServiceUnavailableError`:
nothing listens at the socket, or it did not answer in time) is not a reason an engine does not start:
unless ``required``, the engine starts without it -- one warning line, host misses -- and its heartbeat
attaches when the service appears (:mod:`kvtier.service.leased`). A service that answers and refuses
(another user's listener, a format or protocol it does not serve) is an error at start either way.
"""

from __future__ import annotations

import functools
import logging

from kvtier.errors import ServiceUnavailableError
from kvtier.hashing import Namespace
from kvtier.pools.host import HostPool
from kvtier.service.client import DEFAULT_DEADLINE_S, ServiceClient
from kvtier.service.heartbeat import HEARTBEAT_S
from kvtier.service.leased import LeasedPages
from kvtier.service.region import ObjectPool, RegionFormat
from kvtier.spec import KVSpec

log = logging.getLogger(__name__)


def attach_pages(socket_path: str, fmt: RegionFormat, namespace: Namespace | str, share: int | None, *,
                 deadline_s: float = DEFAULT_DEADLINE_S, lookup_deadline_s: float | None = None,
                 service_uid: int | None = None, required: bool = False, heartbeat_s: float | None = HEARTBEAT_S) -> LeasedPages:
    """The host allocator of an engine attached to the service at ``socket_path`` in ``namespace``, for
    pages of ``fmt``: a :class:`LeasedPages` holding at most ``share`` of the region's pages (None: as many as
    the region has; a share larger than the region is warned of, once, and held to the region). ``close()``
    detaches. The deadlines and ``service_uid`` are :class:`ServiceClient`'s (``TierConfig.service_timeout_s``,
    ``service_lookup_timeout_s``, ``service_uid``); ``required`` (``TierConfig.service_required``): a service that
    does not answer is an error, not a start without it; ``heartbeat_s``: the attachment's beat (None: none)."""
    connect = functools.partial(ServiceClient.reattach, socket_path, str(namespace), fmt, deadline_s=deadline_s,
                                lookup_deadline_s=lookup_deadline_s, service_uid=service_uid, share=share)
    try:
        client = ServiceClient(socket_path, str(namespace), fmt, deadline_s=deadline_s, lookup_deadline_s=lookup_deadline_s,
                               service_uid=service_uid, share=share)
    except ServiceUnavailableError as e:
        if required:
            raise
        log.warning("kvtier: %s; this engine starts without the node service (host misses) and attaches when it answers "
                    "(service_required=true makes this an error)", e)
        client = None
    try:
        return LeasedPages(client, share, socket_path=socket_path, connect=connect, heartbeat_s=heartbeat_s)
    except BaseException:
        if client is not None:
            client.close()
        raise


def attach_host_pool(socket_path: str, spec: KVSpec, layout: str, namespace: Namespace, share: int, *,
                     objects: dict[str, KVSpec] | None = None, deadline_s: float = DEFAULT_DEADLINE_S,
                     lookup_deadline_s: float | None = None, service_uid: int | None = None, required: bool = False,
                     heartbeat_s: float | None = HEARTBEAT_S) -> HostPool:
    """A :class:`HostPool` over the region of the service at ``socket_path`` (mapped, not copied, once it is
    checked to be the service's: :meth:`ServiceClient.map_region`), whose allocator is :func:`attach_pages`'.
    Started without the service (it did not answer), the pool holds no page until the allocator attaches and
    maps the region into it. ``pool.allocator.close()`` detaches (the cache that uses the pool does so when it closes).

    ``objects``: a hybrid model's groups that keep objects of their own beside the pages (name -> the group's object
    spec): the region holds a pool of each (:meth:`RegionFormat.with_objects`), and
    :func:`object_host_pools` gives their host pools over it."""
    objects = objects or {}
    fmt = RegionFormat.of(spec, layout).with_objects([ObjectPool(name, ospec) for name, ospec in objects.items()])
    leased = attach_pages(socket_path, fmt, namespace, share, deadline_s=deadline_s,
                          lookup_deadline_s=lookup_deadline_s, service_uid=service_uid, required=required, heartbeat_s=heartbeat_s)

    def builder(pool_spec: KVSpec, allocator, name: str):
        return lambda memory, num_pages: HostPool(pool_spec, num_pages, layout, memory=memory, allocator=allocator, name=name,
                                                  pin_memory=memory.is_pinned())

    try:
        builders = {k: builder(ospec, leased.objects(k, name), f"node service region, KV group {name!r}")
                    for k, (name, ospec) in enumerate(objects.items(), start=1)}
        return leased.set_pool(builder(spec, leased, "node service region"), builders)
    except BaseException:
        leased.close(quiesced=True)
        raise


def object_host_pools(host: HostPool, objects: list[str]) -> dict[str, HostPool]:
    """The host pools of the object pools :func:`attach_host_pool` attached ``host`` with (``objects``: their names, in the
    order given there), by name."""
    leased: LeasedPages = host.allocator
    return {name: leased.object_pool(k) for k, name in enumerate(objects, start=1)}

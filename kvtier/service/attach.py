"""An engine attaches to the node service: its host allocator leases the service's pages, and its host
pool (where this process holds the bytes) is a view of the service's region."""

from __future__ import annotations

from kvtier.hashing import Namespace
from kvtier.pools.host import HostPool
from kvtier.service.client import DEFAULT_DEADLINE_S, ServiceClient
from kvtier.service.leased import LeasedPages
from kvtier.service.region import RegionFormat
from kvtier.spec import KVSpec


def attach_pages(socket_path: str, fmt: RegionFormat, namespace: Namespace | str, share: int | None, *,
                 deadline_s: float = DEFAULT_DEADLINE_S, lookup_deadline_s: float | None = None,
                 service_uid: int | None = None) -> LeasedPages:
    """The host allocator of an engine attached to the service at ``socket_path`` in ``namespace``, for
    pages of ``fmt``: a :class:`LeasedPages` holding at most ``share`` of the region's pages (None: as many as
    the region has; a share larger than the region is warned of, once, and held to the region). ``close()``
    detaches. The deadlines and ``service_uid`` are :class:`ServiceClient`'s (``TierConfig.service_timeout_s``,
    ``service_lookup_timeout_s``, ``service_uid``)."""
    client = ServiceClient(socket_path, str(namespace), fmt, deadline_s=deadline_s, lookup_deadline_s=lookup_deadline_s,
                           service_uid=service_uid, share=share)
    try:
        return LeasedPages(client, share)
    except BaseException:
        client.close()
        raise


def attach_host_pool(socket_path: str, spec: KVSpec, layout: str, namespace: Namespace, share: int, *,
                     deadline_s: float = DEFAULT_DEADLINE_S, lookup_deadline_s: float | None = None,
                     service_uid: int | None = None) -> HostPool:
    """A :class:`HostPool` over the region of the service at ``socket_path`` (mapped, not copied, once it is
    checked to be the service's: :meth:`ServiceClient.map_region`), whose allocator is :func:`attach_pages`'.
    ``pool.allocator.close()`` detaches (the cache that uses the pool does so when it closes)."""
    leased = attach_pages(socket_path, RegionFormat.of(spec, layout), namespace, share, deadline_s=deadline_s,
                          lookup_deadline_s=lookup_deadline_s, service_uid=service_uid)
    client = leased.client
    try:
        memory = client.map_region()
        leased.pool = HostPool(spec, client.num_pages, layout, memory=memory, allocator=leased, name="node service region",
                               pin_memory=memory.is_pinned())
        return leased.pool
    except BaseException:
        client.close()
        raise

"""An engine attaches to the node service: its host pool becomes a view of the service's region."""

from __future__ import annotations

from kvtier.hashing import Namespace
from kvtier.pools.host import HostPool
from kvtier.service.client import DEFAULT_DEADLINE_S, ServiceClient
from kvtier.service.leased import LeasedPages
from kvtier.service.region import RegionFormat, map_region
from kvtier.spec import KVSpec


def attach_host_pool(socket_path: str, spec: KVSpec, layout: str, namespace: Namespace, share: int, *,
                     deadline_s: float = DEFAULT_DEADLINE_S, lookup_deadline_s: float | None = None) -> HostPool:
    """A :class:`HostPool` over the region of the service at ``socket_path`` (mapped, not copied), whose
    allocator is a :class:`LeasedPages` holding at most ``share`` of its pages for this engine.
    ``pool.allocator.close()`` detaches (the cache that uses the pool does so when it closes). The
    deadlines are :class:`ServiceClient`'s (``TierConfig.service_timeout_s``, ``service_lookup_timeout_s``)."""
    client = ServiceClient(socket_path, str(namespace), RegionFormat.of(spec, layout), deadline_s=deadline_s,
                           lookup_deadline_s=lookup_deadline_s)
    try:
        memory = map_region(client.region, client.region_size)
        leased = LeasedPages(client, share)
        leased.pool = HostPool(spec, client.num_pages, layout, memory=memory, allocator=leased, name="node service region")
        return leased.pool
    except BaseException:
        client.close()
        raise

"""``kvtier serve``: the node service, a host tier outside the engine that every engine on the node shares.

One process owns a shared-memory region laid out as a host pool (:mod:`~kvtier.service.region`) and
the host-tier policy over its page ids (:mod:`~kvtier.service.index`), and answers engines over a Unix
socket (:mod:`~kvtier.service.server`; who may attach: :mod:`~kvtier.service.peer`; what crosses:
:mod:`~kvtier.service.wire`, :mod:`~kvtier.service.messages`). An engine attaches with a
:class:`~kvtier.service.client.ServiceClient` and maps the region; its cache's host pool is a view of
it (:mod:`~kvtier.service.attach`) and its core's host allocator holds pages of it
(:mod:`~kvtier.service.leased`). See docs/service.md.
"""

"""An engine process attached to a node service, run by tests/test_service.py:
``python -m support.service_peer ROLE SOCKET [ARGS]``. It prints one JSON line when its part is done.

* ``compute SOCKET``: a HierarchicalCache computes a 5-page prompt (labelled bytes), its backups
  published; then it stays attached until a line arrives on stdin.
* ``load SOCKET OUT``: a HierarchicalCache begins the same prompt, waits for its loads, and writes the
  bytes of its cached device pages to OUT.
* ``write-and-hang SOCKET``: a raw client reserves 4 pages, writes into all 4, publishes 2 (keys
  :data:`PUBLISHED`), leaves 2 mid-write (:data:`UNPUBLISHED`), prints, and sleeps (to be SIGKILLed).
"""

from __future__ import annotations

import json
import sys
import time

from support.cache_helpers import tokens, write_page
from support.pools import tiny_specs

from kvtier.build import build_cache
from kvtier.config import TierConfig
from kvtier.pools.host import HostPool
from kvtier.service.client import ServiceClient
from kvtier.service.region import RegionFormat, map_region

SPEC = tiny_specs()["dsa"]
PROMPT = tokens(1000, SPEC.page_size * 5)
PUBLISHED = [bytes([i]) * 16 for i in (1, 2)]
UNPUBLISHED = [bytes([i]) * 16 for i in (3, 4)]
NAMESPACE = "service-test-raw"


def cache(sock: str):
    return build_cache(SPEC, TierConfig(device_pages=16, host_pages=32, service=sock))


def compute(sock: str) -> None:
    c = cache(sock)
    req = c.begin(PROMPT)
    new = req.alloc(len(PROMPT) // SPEC.page_size)
    for i, page in enumerate(new.pages):
        write_page(c.device, page, PROMPT, i)
    req.commit(new.pages)
    c.wait_idle()  # the backups finished: published
    print(json.dumps({"device_hit": req.device_hit, "host_hit": req.host_hit, "backed_up": c.stats.backed_up_pages}), flush=True)
    sys.stdin.readline()
    c.check_integrity(idle=True)
    c.close()


def load(sock: str, out: str) -> None:
    c = cache(sock)
    req = c.begin(PROMPT)
    req.wait()
    with open(out, "wb") as f:
        for page in req.cached_pages:
            f.write(c.device.page_bytes(page))
    print(json.dumps({"device_hit": req.device_hit, "host_hit": req.host_hit, "storage_hit": req.storage_hit,
                      "cached": len(req.cached_pages), "shared_host_pages": c.stats.shared_host_pages}), flush=True)
    req.commit(req.cached_pages)
    c.wait_idle()
    c.check_integrity(idle=True)
    c.close()


def write_and_hang(sock: str) -> None:
    client = ServiceClient(sock, NAMESPACE, RegionFormat.of(SPEC, "page_first"))
    pool = HostPool(SPEC, client.num_pages, "page_first", memory=map_region(client.region, client.region_size))
    pages = client.reserve(4)
    for p in pages:  # bytes into every page; the last two's write is never finished
        for t in pool.buffers.values():
            t[p].fill_(0xEE)
    client.publish(pages[:2], PUBLISHED)
    client.status()  # a round trip: the service has applied the publish
    print(json.dumps({"pages": pages}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    role, sock, *rest = sys.argv[1:]
    {"compute": compute, "load": load, "write-and-hang": write_and_hang}[role](sock, *rest)

"""An engine process attached to a node service, run by tests/test_service.py:
``python -m support.service_peer ROLE SOCKET [ARGS]``. It prints one JSON line when its part is done.

* ``compute SOCKET``: a HierarchicalCache computes a 5-page prompt (labelled bytes), its backups
  published; then it stays attached until a line arrives on stdin.
* ``load SOCKET OUT [SEED]``: a HierarchicalCache begins the same prompt (or :func:`prompt` ``SEED``), waits
  for its loads, writes the bytes of its cached device pages to OUT, and computes the rest.
* ``load-l3 SOCKET OUT``: ``load`` with a lookup deadline of :data:`PATIENT_LOOKUP_S` (half of it the time a
  service with an L3 tier may take to fetch the prompt's pages from its store before it answers).
* ``load-store URL OUT``: ``load`` by an engine with no service and an L3 tier of its own at URL.
* ``write-and-hang SOCKET``: a raw client reserves 4 pages, writes into all 4, publishes 2 (keys
  :data:`PUBLISHED`), leaves 2 mid-write (:data:`UNPUBLISHED`), prints, and sleeps (to be SIGKILLed).
* ``violate SOCKET``: the same client's 4 pages, 2 published; then it breaks the protocol and is dropped,
  and prints. Each stdin line then: ``write`` (it goes on writing into its 2 unpublished pages, as a
  copy still in flight would), ``reattach`` (it attaches again naming its dropped session, quiesced),
  ``exit``.
* ``stop-reading SOCKET``: a raw socket client attaches and reserves 2 pages (it holds their leases), prints,
  and on a ``flood`` line sends lookups at a steady pace and never reads an answer, until a send fails (the
  service dropped it); it prints when, and lives on until a line arrives on stdin.
* ``attach SOCKET``: a client attaches, prints its session (or the error that refused it), and detaches.
* ``serve SOCKET``: a HierarchicalCache serving requests, each stdin line a JSON command -- ``{"loop": n}``
  (requests over ``n`` prompts, round and round, each followed by the one 4 back, until the next line arrives; a ``{"warm": requests}``
  line once a prompt's worth of pages were host hits), ``{"compute": seed}``,
  ``{"load": seed}`` (one request for :func:`prompt` ``seed``, its backups waited for), ``{"exit": true}``
  -- each answered with one JSON line: requests served, cached pages whose bytes were not the prompt's
  (checked on every request), host hits, and the service's losses and reattachments.
"""

from __future__ import annotations

import json
import select
import sys
import time

from support.cache_helpers import expected_page, tokens, write_page
from support.pools import tiny_specs

from kvtier.build import build_cache
from kvtier.config import StorageConfig, TierConfig
from kvtier.pools.host import HostPool
from kvtier.errors import ServiceProtocolError
from kvtier.service.client import ServiceClient, SessionWriter
from kvtier.service.region import RegionFormat, map_region

SPEC = tiny_specs()["dsa"]
PROMPT = tokens(1000, SPEC.page_size * 5)
PUBLISHED = [bytes([i]) * 16 for i in (1, 2)]
UNPUBLISHED = [bytes([i]) * 16 for i in (3, 4)]
NAMESPACE = "service-test-raw"
#: ``load-l3``'s lookup deadline: generous, for a loaded machine (the store's reads are what is tested, not their speed)
PATIENT_LOOKUP_S = 5.0


def cache(sock: str, lookup_s: float | None = None):
    return build_cache(SPEC, TierConfig(device_pages=16, host_pages=32, service=sock, service_lookup_timeout_s=lookup_s))


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


def load(sock: str, out: str, seed: str | None = None) -> None:
    _load(cache(sock), PROMPT if seed is None else prompt(int(seed)), out)


def load_l3(sock: str, out: str) -> None:
    _load(cache(sock, PATIENT_LOOKUP_S), PROMPT, out)


def load_store(url: str, out: str) -> None:
    _load(build_cache(SPEC, TierConfig(device_pages=16, host_pages=32), storage=StorageConfig(url=url)), PROMPT, out)


def _load(c, toks: list[int], out: str) -> None:
    req = c.begin(toks)
    req.wait()
    with open(out, "wb") as f:
        for page in req.cached_pages:
            f.write(c.device.page_bytes(page))
    print(json.dumps({"device_hit": req.device_hit, "host_hit": req.host_hit, "storage_hit": req.storage_hit,
                      "cached": len(req.cached_pages), "shared_host_pages": c.stats.shared_host_pages}), flush=True)
    new = req.alloc(len(toks) // SPEC.page_size - len(req.cached_pages))  # (what was not cached: computed, as an engine does)
    for i, page in enumerate(new.pages, len(req.cached_pages)):
        write_page(c.device, page, toks, i)
    req.commit(req.cached_pages + new.pages)
    c.wait_idle()
    c.check_integrity(idle=True)
    c.close()


def _four_pages_two_published(sock: str) -> tuple[ServiceClient, HostPool, list[int]]:
    client = ServiceClient(sock, NAMESPACE, RegionFormat.of(SPEC, "page_first"))
    pool = HostPool(SPEC, client.num_pages, "page_first", memory=map_region(client.region, client.region_size))
    pages = client.reserve(4)
    fill(pool, pages, 0xEE)  # bytes into every page; the last two's write is never finished
    client.publish(pages[:2], PUBLISHED)
    client.status()  # a round trip: the service has applied the publish
    return client, pool, pages


def fill(pool: HostPool, pages: list[int], byte: int) -> None:
    for p in pages:
        for t in pool.buffers.values():
            t[p].fill_(byte)


def attach(sock: str) -> None:
    from kvtier.errors import ServiceError

    try:
        client = ServiceClient(sock, NAMESPACE, RegionFormat.of(SPEC, "page_first"))
    except ServiceError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        return
    print(json.dumps({"session": client.session}), flush=True)
    client.close()


def write_and_hang(sock: str) -> None:
    client, _pool, pages = _four_pages_two_published(sock)
    print(json.dumps({"pages": pages, "session": client.session}), flush=True)
    time.sleep(600)


def join(sock: str, session: str) -> None:
    """Join ``session`` as a process that writes into its pages (a vLLM worker of its engine), then hang."""
    writer = SessionWriter(sock, session, 10.0)  # (kept: its connection is the join)
    print(json.dumps({"joined": writer.session}), flush=True)
    time.sleep(600)


def violate(sock: str) -> None:
    client, pool, pages = _four_pages_two_published(sock)
    client.note([{"op": "format_disk"}])  # a protocol violation: the service refuses it and drops this client
    try:
        client.status()
        error = None
    except ServiceProtocolError as e:
        error = type(e).__name__
    print(json.dumps({"pages": pages, "error": error}), flush=True)
    for line in sys.stdin:
        if line.strip() == "write":
            fill(pool, pages[2:], 0x55)
            print(json.dumps({"wrote": pages[2:]}), flush=True)
        elif line.strip() == "reattach":
            again = ServiceClient(sock, NAMESPACE, RegionFormat.of(SPEC, "page_first"), previous=client.session)
            print(json.dumps({"session": again.session}), flush=True)
            again.close()
        else:
            return


def stop_reading(sock: str) -> None:
    import socket

    from support.service import read_answer

    from kvtier.service.messages import Hello, Lookup, Reserve
    from kvtier.service.wire import encode

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10.0)  # (a send into a full buffer fails rather than hangs)
    s.connect(sock)
    hello = Hello(namespace=NAMESPACE, format=RegionFormat.of(SPEC, "page_first").as_wire())
    s.sendall(encode({"seq": 1, "ops": [hello.wire(), Reserve(n=2).wire()]}))
    pages = read_answer(s)["results"][1]  # the last answer it reads
    print(json.dumps({"pages": pages}), flush=True)
    sys.stdin.readline()
    lookups = [Lookup(keys=[bytes([9, i]) * 8]).wire() for i in range(256)]  # misses: each answered with an empty run
    start, frames = time.monotonic(), 0
    while time.monotonic() - start < 120:
        try:
            s.sendall(encode({"seq": 2 + frames, "ops": lookups}))
        except OSError:  # the service closed the connection: dropped
            break
        frames += 1
        time.sleep(0.005)
    print(json.dumps({"dropped_after_s": time.monotonic() - start, "frames": frames}), flush=True)
    sys.stdin.readline()


def prompt(seed: int) -> list[int]:
    """A 5-page prompt of its own for each seed (every engine builds the same one)."""
    return tokens(100_000 * (seed + 1), len(PROMPT))


class Serving:
    """One engine's requests, every cached page's bytes checked against the prompt's."""

    def __init__(self, sock: str, lookup_s: float | None = None):
        self.cache = cache(sock, lookup_s)
        self.requests = self.bad = self.host_hit = self.cached = 0

    def request(self, toks: list[int]) -> None:
        c = self.cache
        req = c.begin(toks)
        n = req.wait()
        self.bad += sum(c.device.page_bytes(p) != expected_page(SPEC, toks, i) for i, p in enumerate(req.cached_pages))
        new = req.alloc(len(toks) // SPEC.page_size - n)
        for i, page in enumerate(new.pages, n):
            write_page(c.device, page, toks, i)
        req.commit(req.cached_pages + new.pages)
        self.requests += 1
        self.host_hit += req.host_hit
        self.cached += n

    def report(self) -> dict:
        leased = self.cache.host.allocator
        return {"requests": self.requests, "bad": self.bad, "host_hit": self.host_hit, "cached": self.cached, "lost": leased.losses,
                "reattaches": leased.reattaches, "attached": not leased.lost, "lost_pages": self.cache.stats.shared_host_lost_pages,
                "shared_host_pages": self.cache.stats.shared_host_pages}


def serve(sock: str) -> None:
    s = Serving(sock)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "loop" in cmd:
            prompts = [prompt(i) for i in range(cmd["loop"])]
            i, warm = 0, False
            while not select.select([sys.stdin], [], [], 0)[0]:  # until the next line comes
                s.request(prompts[i % len(prompts)])
                s.request(prompts[(i - 4) % len(prompts)])  # (off its 3-prompt device, on its 6-prompt host share: read back)
                i += 1
                if not warm and s.host_hit >= len(PROMPT) // SPEC.page_size:
                    print(json.dumps({"warm": s.requests}), flush=True)  # (a prompt's worth of host hits: it uses the host tier)
                    warm = True
            sys.stdin.readline()
        elif "compute" in cmd or "load" in cmd:
            s.request(prompt(cmd.get("compute", cmd.get("load"))))
            s.cache.wait_idle()  # its backups finished: published
        else:
            break
        print(json.dumps(s.report()), flush=True)
        s.requests = s.bad = s.host_hit = s.cached = 0
    s.cache.wait_idle()
    s.cache.check_integrity(idle=True)
    s.cache.close()


if __name__ == "__main__":
    role, sock, *rest = sys.argv[1:]
    roles = {"compute": compute, "load": load, "load-l3": load_l3, "load-store": load_store, "write-and-hang": write_and_hang,
             "violate": violate, "serve": serve, "stop-reading": stop_reading, "join": join,
             "attach": attach}
    roles[role](sock, *rest)

"""kvtier as a library: one request prefilled, demoted to host and storage, then served again.

Run: python examples/library_quickstart.py   (CPU; set device="cuda" in TierConfig on a GPU machine)
"""

import shutil
import tempfile

import torch

from kvtier import KVSpec
from kvtier.build import TierConfig, build_cache
from kvtier.config import CacheConfig, StorageConfig

spec = KVSpec.preset("deepseek-v3.2").with_(num_layers=4)  # MLA latent + DSA indexer, 64-token pages
store = tempfile.mkdtemp(prefix="kvtier-l3-")
cache = build_cache(spec, TierConfig(device_pages=16, host_pages=32), CacheConfig(write_policy="write_through"),
                    StorageConfig(url=f"file://{store}"))

prompt = list(range(1000, 1000 + 5 * 64 + 10))  # 5 full pages and a 10-token tail (never shared)

# 1. First time: nothing cached. The engine computes KV into freshly allocated device pages...
req = cache.begin(prompt)                                 # match (nothing), lock
assert req.num_cached == 0
pages = req.alloc(6).pages                                # 5 full pages + the tail page
gen = torch.Generator().manual_seed(0)
for layer in range(spec.num_layers):                      # stand-in for the model writing KV and indexer keys
    for b in spec.buffers:
        rows = cache.device.rows(b.name, layer)           # [num_pages, page_bytes] view of that buffer
        rows.view(torch.uint8)[pages] = torch.randint(0, 256, (len(pages), b.page_bytes), dtype=torch.uint8, generator=gen)
original = [cache.device.page_bytes(p) for p in pages[:5]]
req.commit(pages)                                         # ...full pages to the cache, the tail page freed, unlocked

# 2. Memory pressure: everything leaves the device, then the host (write_through has saved it to L3).
cache.wait_idle()
cache.evict_device(cache.device.num_pages)
cache.evict_host(cache.host.num_pages)

# 3. The same prompt again: a storage hit, prefetched into host pages, loaded layer by layer.
req = cache.begin(prompt)                                 # match, lock, L3 prefetch (wait_complete), load back
print(f"device {req.device_hit}, host {req.host_hit}, storage {req.storage_hit} pages")
for layer in range(spec.num_layers):
    req.wait_layer(layer)                                 # attend layer i while later layers still move
req.wait()
assert [cache.device.page_bytes(p) for p in req.cached_pages] == original, "bytes differ"
tail = req.alloc(1).pages                                 # the engine recomputes only the 10-token tail
req.commit(req.cached_pages + tail)
print("5 pages restored bit-exact (latent KV and DSA indexer) from", store)
cache.wait_idle()                                         # completions are applied: stats count the load
print(cache.stats)
cache.close()
shutil.rmtree(store)

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
m = cache.match(prompt)
assert m.num_device_pages == 0
cache.lock(m.last_node)
pages = cache.alloc_device(6).pages                       # 5 full pages + the tail page
gen = torch.Generator().manual_seed(0)
for layer in range(spec.num_layers):                      # stand-in for the model writing KV and indexer keys
    for b in spec.buffers:
        rows = cache.device.rows(b.name, layer)           # [num_pages, page_bytes] view of that buffer
        rows.view(torch.uint8)[pages] = torch.randint(0, 256, (len(pages), b.page_bytes), dtype=torch.uint8, generator=gen)
original = [cache.device.page_bytes(p) for p in pages[:5]]
cache.insert(prompt[: 5 * 64], pages[:5])           # ...and hands the full pages to the cache
cache.free_device(pages[5:])                              # the tail page stays the engine's
cache.unlock(m.last_node)

# 2. Memory pressure: everything leaves the device, then the host (write_through has saved it to L3).
cache.wait_idle()
cache.evict_device(cache.device.num_pages)
cache.evict_host(cache.host.num_pages)

# 3. The same prompt again: a storage hit, prefetched into host pages, loaded layer by layer.
m = cache.match(prompt)
print(f"device {m.num_device_pages}, host {m.num_host_pages}, storage {m.num_storage_pages} pages")
cache.lock(m.last_node)
cache.resolve_prefetch(cache.prefetch(m))                 # wait_complete by default
m2 = cache.match(prompt, count=False)
cache.lock(m2.last_node)
cache.unlock(m.last_node)
load = cache.load_back(m2)
for layer in range(spec.num_layers):
    load.wait_layer(layer)                                # attend layer i while later layers still move
load.wait()
assert [cache.device.page_bytes(p) for p in load.device_pages] == original, "bytes differ"
cache.unlock(m2.last_node)
print("5 pages restored bit-exact (latent KV and DSA indexer) from", store)
cache.wait_idle()                                         # completions are applied: stats count the load
print(cache.stats)
cache.close()
shutil.rmtree(store)

"""``KVTierConnector``: a vLLM v1 KV connector backed by kvtier's host and storage tiers.

vLLM's own GPU prefix cache is the device tier; kvtier adds host memory (L2)
and a storage tier (L3: file, Redis, Mooncake) below it, shared across engine
restarts and instances through L3.

The connector is two objects that share nothing but vLLM's messages, so it
runs wherever vLLM puts them -- one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
vLLM's default engine-core process with its workers, any tensor-parallel size:

* the scheduler side (:mod:`.scheduler`) owns kvtier's policy core: which pages
  are cached where, host page ids, LRU, L3 save state. It plans; its plans go
  to the workers in the step's connector metadata;
* each worker (:mod:`.worker`, one per tensor-parallel rank) holds the bytes:
  vLLM's KV blocks, its host shard (same page ids on every rank), its L3 I/O
  under a namespace that carries its rank. It runs the plans and reports their
  completions back (``build_connector_worker_meta``), joined over ranks before
  the core sees them: a page is loaded or saved only when every rank has it.

With ``service`` (the node service, ``kvtier serve``) the host tier is the
service's shared region: the scheduler's core leases, looks up and publishes its
pages, and each worker maps its rank's slice of the region the step's metadata
names (:mod:`kvtier.service`, docs/service.md).

Hybrid models (:class:`SupportsHMA`): vLLM keeps its hybrid KV cache manager on,
and the connector serves its full-attention, sliding-window and block-aligned
state groups (:mod:`.groups`; anything else is refused at start-up with the
group and why).

Start-up: each worker tells the scheduler, once, what its tensors make
(``get_handshake_metadata`` -> ``set_xfer_handshake_metadata``, vLLM's
handshake path), and the scheduler builds the core from it. Messages:
:mod:`.messages`. Pages that could not be loaded are reported through
``get_block_ids_with_load_errors`` and recomputed (set
``kv_load_failure_policy="recompute"``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvtier.logs import log_to_stderr_unless_configured, refusing_start
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.groups import groups_of
from kvtier.integrations.vllm.layout import ModelShape
from kvtier.integrations.vllm.messages import KVTierConnectorMetadata, KVTierHandshake, KVTierWorkerMeta
from kvtier.integrations.vllm.metrics import KVTierConnectorStats, KVTierPromMetrics
from kvtier.integrations.vllm.options import ConnectorOptions
from kvtier.integrations.vllm.scheduler import ConnectorScheduler, HitRecord
from kvtier.integrations.vllm.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["HitRecord", "KVTierConnector", "KVTierConnectorMetadata"]


def _model_shape(vllm_config: VllmConfig, name: str) -> ModelShape:
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    use_mla = bool(getattr(mc, "use_mla", False))
    return ModelShape(
        name=name,
        block_size=vllm_config.cache_config.block_size,
        kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(),
        use_mla=use_mla,
        kv_lora_rank=getattr(hf, "kv_lora_rank", 0) if use_mla else 0,
        qk_rope_dim=getattr(hf, "qk_rope_head_dim", 0) if use_mla else 0,
    )


def _refusing_start():
    """A start kvtier refuses (a bad option, a split or model the node service cannot serve, a required service
    that does not answer) is one ERROR line first, naming the fix, above vLLM's traceback of it."""
    return refusing_start(log, "kvtier connector", ("kvtier connector: ",))


def context_parallel(parallel) -> dict[str, int]:
    """vLLM's decode and prefill context-parallel sizes (1 where its config has none): above 1, each rank holds
    other tokens' KV, MLA's latent included."""
    return {name: getattr(parallel, f"{name}_size", 1) or 1 for name in ("decode_context_parallel", "prefill_context_parallel")}


def check_parallel(parallel, options: ConnectorOptions) -> None:
    """vLLM's parallel config is one kvtier serves: tensor parallel only (pipeline parallel size 1), and no
    context parallelism with the node service -- it stores MLA's latent once, as every rank holds it whole,
    where context parallelism splits it by tokens across the ranks."""
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("kvtier connector: pipeline parallel size must be 1 (tensor parallel is supported)")
    context = context_parallel(parallel)
    if options.tiers.service and max(context.values()) > 1:
        raise ConfigError(f"kvtier connector: the node service (service=...) needs context parallel sizes of 1, got {context}; "
                          "drop decode/prefill context parallelism, or the service")


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        log_to_stderr_unless_configured()  # (vLLM configures its own logger only: kvtier's lines get a time and a level)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        with _refusing_start():
            self._start(vllm_config, role, kv_cache_config)

    def _start(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None) -> None:
        groups = groups_of(kv_cache_config) if kv_cache_config is not None else None
        self.options = ConnectorOptions.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        parallel = vllm_config.parallel_config
        check_parallel(parallel, self.options)
        model = vllm_config.model_config.model
        self.model_name = self.options.model_name or os.path.basename(str(model).rstrip("/")) or str(model)
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ConnectorScheduler(self.options, self.block_size, parallel.world_size, self.model_name, groups)
        else:
            self.worker = ConnectorWorker(self.options, _model_shape(vllm_config, self.model_name), self.model_name, parallel.rank, groups,
                                          parallel.world_size, shared_latent=max(context_parallel(parallel).values()) == 1)
        self._handshake: KVTierHandshake | None = None
        #: the metadata of the step the worker has begun (see _begin_step)
        self._step_meta: KVTierConnectorMetadata | None = None

    @property
    def hits(self):
        """The scheduler side's latest lookups (for reports in the scheduler's process)."""
        return self.scheduler.hits if self.scheduler is not None else ()

    # ==== worker side ===================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with _refusing_start():
            self._handshake = self.worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVTierHandshake | None:
        return self._handshake

    def _begin_step(self) -> None:
        """Hand the step's plans to the worker, once, at whichever of vLLM's calls comes first: vLLM
        0.32 calls ``start_load_kv`` before the forward only in steps with synchronous loads, and
        after it otherwise -- by then every layer's ``save_kv_layer`` has come and gone."""
        meta = self._get_connector_metadata()
        if meta is not self._step_meta:
            assert isinstance(meta, KVTierConnectorMetadata)
            self._step_meta = meta
            self.worker.begin_step(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._begin_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._begin_step()
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Layer ``layer_name`` of the blocks this step computes is written: its copy out to host memory starts."""
        self._begin_step()
        self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._begin_step()
        self.worker.finish_step()
        self._step_meta = None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks vLLM kept for kvtier's copies out of them: those copies are done."""
        return (self.worker.finished_sending() or None) if self.worker is not None else None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and a hybrid model's asynchronous loads: the requests whose load ended on
        this worker, and those of them that failed (vLLM recomputes them)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        recving, failed = self.worker.finished_recving()
        return KVConnectorTransferResults(finished_sending=self.worker.finished_sending(), finished_recving=recving,
                                          failed_recving=failed)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before a step may overwrite blocks -- preempted requests', window blocks vLLM allocated again --
        kvtier's copies out of them are done."""
        if self.worker is not None and isinstance(kv_connector_metadata, KVTierConnectorMetadata):
            self.worker.wait_copies(kv_connector_metadata.preempted_copies)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker.take_results() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVTierConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierConnectorStats:
        return KVTierConnectorStats(dict(data)) if data else KVTierConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # ==== scheduler side ================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        with _refusing_start():  # (the scheduler attaches to the node service here)
            self.scheduler.handshake(metadata)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, num_external_tokens, blocks.get_block_ids() if self.scheduler.groups else ())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: once per request, every group's blocks kept while kvtier may still
        copy out of (or load into) any of them."""
        return self.scheduler.request_finished(request)

    def take_events(self):
        """kvtier's host and L3 tiers as vLLM KV events (``BlockStored`` / ``BlockRemoved`` with their medium)."""
        return self.scheduler.events.take() if self.scheduler is not None else ()

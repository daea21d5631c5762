"""Executors: the processes that hold bytes run the core's plans and report completions.

* :class:`~kvtier.executors.local.LocalExecutor` -- device<->host on a
  :class:`~kvtier.transfer.engine.TransferEngine`, host<->storage on a
  :class:`~kvtier.l3.tier.StorageTier`, in the caller's process.
* :class:`~kvtier.executors.accounting.AccountingExecutor` -- no bytes at all:
  every copy completes at once and storage is a key set (capacity planning).
* :class:`~kvtier.executors.pipe.PipeExecutor` -- the core's side of a pipe to
  an executor in another process (plans and completions pickled across it).

Each satisfies :class:`~kvtier.core.port.ExecutorPort`, the only thing the
policy core knows about where bytes are.
"""

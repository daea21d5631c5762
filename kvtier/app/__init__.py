"""The application around the library: what ``kvtier`` (the command) runs.

* :mod:`~kvtier.app.cli` -- the command line (typer), one line and exit 2 on bad input;
* :mod:`~kvtier.app.runner`, :mod:`~kvtier.app.engine`, :mod:`~kvtier.app.model` -- ``kvtier run``: a
  small reference MLA+DSA transformer served through the cache and through
  :class:`~kvtier.core.NullCache` (the recompute baseline, in the core);
* :mod:`~kvtier.app.workloads` -- the shipped Mooncake trace and a synthetic chat workload;
* :mod:`~kvtier.app.plan` -- ``kvtier plan``: the policy core replayed over a trace at cluster scale;
* :mod:`~kvtier.app.bench` -- the benchmarks; :mod:`~kvtier.app.devservers` -- Redis/Mooncake on loopback.

The library (``kvtier.spec``, ``pages``, ``pools``, ``transfer``, ``l3``, ``core``,
``executors``, ``cache``, ``integrations``) never imports from here.
"""

"""``kvtier serve``: the node service's command (registered by :mod:`kvtier.app.cli`)."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Optional

import typer

from kvtier.errors import ConfigError


def serve(
    host_gb: Optional[float] = typer.Option(None, "--host-gb", help="host tier size in GB: the shared region every attached engine maps"),
    socket: Optional[str] = typer.Option(
        None, "--socket", help="Unix socket path, in a directory only you can enter (made with mode 0700 if missing); default: "
                               "$XDG_RUNTIME_DIR/kvtier/node.sock, else /tmp/kvtier-<uid>/node.sock"
    ),
    storage_url: Optional[str] = typer.Option(
        None, "--storage-url", help="an L3 tier below the host tier (any kvtier storage URL: file:///dir, redis://host:port/0, "
                                    "mooncake://..., memory://): published pages are saved to it, lookups fetch from it into the region"
    ),
    drain_timeout_s: float = typer.Option(30.0, "--drain-timeout-s", help="on SIGTERM, how long L3 saves under way may take before "
                                                                        "the service stops without them"),
    verify_sample: float = typer.Option(0.01, "--verify-sample", help="the fraction of host hits whose bytes are checked against "
                                                                      "their page's checksum before they are offered (a page that "
                                                                      "fails is dropped: a miss); 1.0: every hit"),
    fresh_region: bool = typer.Option(False, "--fresh-region", help="start with an empty host tier even where a killed service left "
                                                                    "its region on this socket (default: adopt it, offering again "
                                                                    "the pages whose bytes verify)"),
    zero_evicted_pages: bool = typer.Option(False, "--zero-evicted-pages", help="zero a region page's bytes when it is evicted "
                                            "(or its write dropped), before another engine -- another tenant's -- reserves it"),
    tenant_host_pages: int = typer.Option(0, "--tenant-host-pages", help="region pages guaranteed to each tenant (engines label "
                                          "their pages by tenant): no engine's reservation evicts a tenant's pages below this"),
    tenant_max_host_pages: Optional[int] = typer.Option(None, "--tenant-max-host-pages", help="the most region pages one tenant may "
                                                        "hold: at it, its own least recently released pages make room"),
    tenant_ttl_s: Optional[float] = typer.Option(None, "--tenant-ttl-s", help="a region page nobody has held this long leaves "
                                                 "the region (zeroed with --zero-evicted-pages)"),
    tenant_accounting: bool = typer.Option(False, "--tenant-accounting", help="count each tenant's pages, hits and losses (in "
                                           "--status and the metrics, by digest) with no --tenant-* bound set"),
    keep_region: bool = typer.Option(False, "--keep-region", help="on SIGTERM, leave the region for the next service on this socket "
                                                                  "to adopt (an upgrade keeps the host tier) instead of removing it"),
    status: bool = typer.Option(False, "--status", help="print the running service's status as JSON (pages per namespace, clients, "
                                                        "counters) and exit"),
    allow_group: Optional[str] = typer.Option(
        None, "--allow-group", help="also admit processes of other users in this group (name or gid): the socket's directory "
                                    "becomes 0750 and the region 0660 of the group, and its members can read and write every page"
    ),
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", help="serve Prometheus metrics at http://HOST:PORT/metrics (pages and bytes per namespace, hits, "
                                     "clients, lease expiries, dropped writes, protocol errors); 0: a free port, named in the banner"
    ),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="the address --metrics-port listens on"),
    service_uid: Optional[int] = typer.Option(
        None, "--service-uid", help="with --status: the uid the service runs as, when it is not yours (a member of its "
                                    "--allow-group asking); a service of any other uid is refused"
    ),
) -> None:
    """Serve a host tier outside the engine, shared by every engine on the node, until SIGTERM."""
    from kvtier.service.peer import default_socket_path

    path = default_socket_path() if socket is None else socket
    if status:
        from kvtier.service.client import query_status

        json.dump(query_status(path, service_uid=service_uid), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    if host_gb is None:
        raise ConfigError("kvtier serve needs --host-gb: the host tier's size in GB (e.g. --host-gb 64)")
    from kvtier.logs import log_to_stderr_unless_configured
    from kvtier.service.server import NodeService, ServeConfig

    log_to_stderr_unless_configured()

    service = NodeService(ServeConfig(host_gb=host_gb, socket=path, storage_url=storage_url, drain_timeout_s=drain_timeout_s,
                                      allow_group=allow_group, metrics_port=metrics_port, metrics_host=metrics_host,
                                      verify_sample=verify_sample, fresh_region=fresh_region, keep_region=keep_region,
                                      zero_evicted_pages=zero_evicted_pages, tenant_host_pages=tenant_host_pages,
                                      tenant_max_host_pages=tenant_max_host_pages, tenant_ttl_s=tenant_ttl_s,
                                      tenant_accounting=tenant_accounting))
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    try:
        l3 = f", L3 {service.storage.status()['url']}" if service.storage is not None else ""
        metrics = f"; metrics on {service.metrics.url}" if service.metrics is not None else ""
        region = (f"its region adopted: {service.adopted['pages']} pages verified" if service.adopted is not None else
                  "its region made at the first attach")
        print(f"kvtier serve: listening on unix://{path} (pid {os.getpid()}, host tier {host_gb:g} GB, "
              f"{region}{l3}){metrics}", flush=True)
        service.serve(lambda: bool(stop))
    finally:
        service.close()

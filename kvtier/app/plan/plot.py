"""``kvtier plan --plot PNG``: hit ratio against a tier's size per routing policy, and the load per node."""

from __future__ import annotations

from pathlib import Path

from kvtier.app.cli_output import check_output_path
from kvtier.errors import ConfigError

_AXIS = {"host_tb": "host per node (TB)", "device_gb": "device per node (GB)", "storage_tb": "L3 per node (TB)"}


def plot_plan(path: str | Path, field: str, sweeps: dict[str, list[dict]], per_node: dict[str, list[dict]]) -> Path:
    """Write a two-panel PNG: ``sweeps[routing]`` rows (``field`` vs ``hit_total``) and
    ``per_node[routing]`` rows (prompt tokens per node). Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_output_path("--plot", str(path))
    out = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for routing, rows in sweeps.items():
        left.plot([r[field] for r in rows], [r["hit_total"] for r in rows], marker="o", label=routing)
    left.set_xlabel(_AXIS.get(field, field))
    left.set_ylabel("hit ratio (tokens served / input tokens)")
    left.set_title("hit ratio vs capacity")
    left.grid(alpha=0.3)
    left.legend()
    width = 0.8 / max(len(per_node), 1)
    for k, (routing, rows) in enumerate(per_node.items()):
        xs = [r["node"] + k * width for r in rows]
        right.bar(xs, [r["prompt_tokens"] / 1e6 for r in rows], width=width, label=routing)
    right.set_xlabel("node")
    right.set_ylabel("prompt tokens (millions)")
    right.set_title("load per node")
    right.legend()
    fig.tight_layout()
    try:
        fig.savefig(out, format="png", dpi=110)
    except OSError as e:
        raise ConfigError(f"--plot {path}: cannot write it ({e.strerror}); pick a writable path") from None
    finally:
        plt.close(fig)
    return out

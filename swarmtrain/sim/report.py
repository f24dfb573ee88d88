"""The figures of simulation runs, as PNG files (matplotlib, the `sim` extra)."""

from __future__ import annotations

from pathlib import Path

from swarmtrain.errors import ConfigError
from swarmtrain.sim.state import SimResult


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plots needs matplotlib: pip install 'swarmtrain[sim]' (or leave out --plots)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label(result: SimResult) -> str:
    s = result.scenario
    return f"{s.policy}{'' if s.replan else ', no re-planning'} ({s.num_peers} peers)"


def write_plots(results: list[SimResult], folder: str | Path) -> list[Path]:
    """tokens_per_s.png (every run), and per run utilisation, queue depth and layout
    (replicas per stage, with joins, leaves and moves marked). Returns the files written."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        ax.plot(r.series.get("t", []), r.series.get("tokens_per_s", []), label=label(r))
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Throughput over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / "tokens_per_s.png", plt))

    for i, r in enumerate(results):
        tag = f"{i}-{r.scenario.policy}{'' if r.scenario.replan else '-static-layout'}"
        t = r.series.get("t", [])
        for key, title, ylabel in (
            ("utilisation", "Compute utilisation per stage", "busy fraction"),
            ("queue_depth", "Queue depth per stage (tasks per replica)", "tasks"),
            ("replicas", "Layout: replicas per stage", "replicas"),
        ):
            rows = r.series.get(key, [])
            fig, ax = plt.subplots(figsize=(9, 4.5))
            stages = max((len(row) for row in rows), default=0)
            for k in range(stages):
                ax.plot(t, [row[k] if k < len(row) else 0 for row in rows], label=f"stage {k}", lw=1)
            if key == "replicas":
                marks = {"join": ("g", "joins"), "preempted": ("r", "preemptions"), "left": ("r", "leaves"),
                         "move": ("b", "moves")}  # fmt: skip
                seen = set()
                for ev in r.layout:
                    if ev["event"] in marks:
                        color, name = marks[ev["event"]]
                        ax.axvline(
                            ev["t"], color=color, alpha=0.25, lw=0.8, label=None if name in seen else name
                        )
                        seen.add(name)
            ax.set_xlabel("simulated time (s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {label(r)}")
            ax.grid(alpha=0.3)
            if stages <= 16:
                ax.legend(fontsize=7, ncol=2)
            name = "layout" if key == "replicas" else key
            written.append(_save(fig, folder / f"{name}-{tag}.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Timeline PNG of one simulated step: each rollout instance's batch size and speculation over time."""

from __future__ import annotations

from pathlib import Path

from .analysis import Report


def timeline(report: Report, path: str | Path, max_instances: int = 32) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    phase = report.sd.last_phase
    step = report.sd.steps[-1]
    assert phase is not None
    runs = phase.runs[:max_instances]
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(runs) + 2.2))
    peak = max((seg.batch for r in runs for seg in r.segments), default=1)
    norm, cmap = Normalize(0, peak), plt.get_cmap("viridis")
    for i, r in enumerate(runs):
        for seg in r.segments:
            ax.barh(i, seg.end - seg.start, left=seg.start, height=0.8, color=cmap(norm(seg.batch)))
            if seg.gamma:
                ax.barh(i - 0.34, seg.end - seg.start, left=seg.start, height=0.12, color="crimson")
        ax.barh(i, phase.duration - r.finish, left=r.finish, height=0.8, color="#dddddd")
    train_row = len(runs)
    ax.barh(train_row, step.sync_seconds, left=phase.duration, height=0.8, color="orange", label="weight sync")
    ax.barh(train_row, step.train_seconds, left=phase.duration + step.sync_seconds, height=0.8, color="tab:blue",
            label=f"training ({step.trainer_gpus or 'all'} GPUs)")
    ax.set_yticks(list(range(len(runs))) + [train_row],
                  [f"rollout {i} ({phase.tp} GPU)" for i in range(len(runs))] + ["trainer"], fontsize=7)
    ax.set_xlabel("seconds into the step")
    ax.set_title(f"{report.scenario.name}: last step — colour = active batch, red strip = speculating, grey = idle")
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="active sequences")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""curves.png for `mixprec compare`: training loss and loss scale per step, and the validation
metric per epoch, one line per mode (matplotlib, headless)."""

from __future__ import annotations

import math

from .report import ModeResult


def _finite_points(values: list) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for i, v in enumerate(values):
        if v is not None and math.isfinite(v):
            xs.append(i + 1)
            ys.append(v)
    return xs, ys


def plot_curves(path: str, results: list[ModeResult], metric_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also safe when a GUI backend is configured
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_scale, ax_val) = plt.subplots(1, 3, figsize=(16, 4.8))
    for r in results:
        style = "-" if r.status == "ok" else ":"
        label = r.mode if r.status == "ok" else f"{r.mode} ({r.status})"
        xs, ys = _finite_points(r.loss_curve)
        if xs:
            ax_loss.plot(xs, ys, style, label=label, linewidth=1)
        xs, ys = _finite_points(r.scale_curve)
        if xs:
            ax_scale.plot(xs, ys, style, label=label, linewidth=1)
        xs, ys = _finite_points(r.val_metric_curve)
        if xs:
            ax_val.plot(xs, ys, style, marker="o", label=label)
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    ax_loss.set_yscale("log")
    ax_scale.set(title="loss scale (1 = no scaling)", xlabel="step", ylabel="scale")
    ax_scale.set_yscale("log", base=2)
    ax_val.set(title=f"validation {metric_name}", xlabel="epoch", ylabel=metric_name)
    ax_val.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_loss, ax_scale, ax_val):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

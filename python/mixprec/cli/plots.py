"""curves.png for `mixprec compare` (matplotlib, headless): time per epoch, peak memory and (when
a lean mode ran) the optimizer's state bytes per parameter per mode as bars on top; training loss, validation metric (with the tolerance band around O0) and,
when some mode scales its loss, the loss scale below."""

from __future__ import annotations

import math
from typing import Optional

from .modes import BASELINE, is_torch_amp
from .report import OK, ModeResult, memory_comparable, state_lines

# Modes often train to nearly the same curve: colour alone would hide one under another, so
# each mode also gets its own line style and marker.
_LINES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">")


def _finite_points(values: list) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for i, v in enumerate(values):
        if v is not None and math.isfinite(v):
            xs.append(i + 1)
            ys.append(v)
    return xs, ys


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def scales_loss(results: list[ModeResult]) -> bool:
    """Whether any mode used a loss scale other than 1 (else the loss-scale panel says nothing)."""
    return any(_finite(v) and v != 1.0 for r in results for v in r.scale_curve)


def _bars(ax, results: list[ModeResult], values: list[Optional[float]], colors: list, title: str, unit: str,
          notes: list[str]) -> None:
    xs = list(range(len(results)))
    heights = [v if _finite(v) else 0.0 for v in values]
    bars = ax.bar(xs, heights, color=colors)
    for bar, r in zip(bars, results):
        if is_torch_amp(r.mode):
            bar.set_hatch("//")  # the torch.amp baselines stand out from mixprec's modes
    top = max(heights) if any(heights) else 1.0
    for x, v, note in zip(xs, values, notes):
        ax.text(x, (v if _finite(v) else 0.0) + 0.01 * top, note if _finite(v) else "n/a", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(xs, [r.mode for r in results], rotation=30, ha="right")
    ax.set(title=title, ylabel=unit)
    ax.set_ylim(0, top * 1.15)


def check_available() -> Optional[str]:
    """None when curves.png can be drawn, else the one-line reason (matplotlib is an optional extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"curves.png needs matplotlib (pip install 'mixprec[plot]' or pip install matplotlib): {e}"
    return None


def build_figure(results: list[ModeResult], metric_name: str, tolerance: float, higher_is_better: bool):
    """The comparison figure (not saved); its axes' titles name the panels."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; also safe when a GUI backend is configured
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(results))]
    memory = memory_comparable(results)
    scaling = scales_loss(results)
    state = bool(state_lines(results))  # exact counts, so shown on a CPU too
    n_top, n_bottom = 1 + memory + state, 2 + scaling
    fig = plt.figure(figsize=(5.5 * max(n_top, n_bottom), 9.5))
    grid = fig.add_gridspec(2, 6)  # 6 columns: one, two or three panels a row, evenly

    def panel(row: int, i: int, n: int):
        return fig.add_subplot(grid[row, i * 6 // n:(i + 1) * 6 // n])

    ax_time = panel(0, 0, n_top)
    _bars(ax_time, results, [r.time_per_epoch for r in results], colors, "time per epoch (lower is better)",
          "s/epoch", [f"{r.speedup:.2f}x" if _finite(r.speedup) else "" for r in results])
    if memory:
        _bars(panel(0, 1, n_top), results, [r.peak_memory_mb for r in results], colors,
              "peak memory (lower is better)", "MiB", [f"{r.peak_memory_mb:.0f}" if _finite(r.peak_memory_mb)
                                                       else "" for r in results])
    if state:
        _bars(panel(0, 1 + memory, n_top), results, [r.state_bytes_per_param for r in results], colors,
              "optimizer state per parameter (lower is better)", "bytes",
              [f"{r.state_bytes_per_param:.3g} (master {r.master_bytes_per_param:.3g})"
               if _finite(r.state_bytes_per_param) else "" for r in results])
    ax_loss, ax_val = panel(1, 0, n_bottom), panel(1, 1, n_bottom)
    ax_scale = panel(1, 2, n_bottom) if scaling else None
    def spread(n: int, i: int) -> tuple[int, int]:
        # Markers on every k-th point, each mode starting at another one: curves lying on top of
        # each other still show every mode's markers side by side.
        every = max(1, min(n, max(n // 8, len(results))))
        return (i % every, every)

    for i, r in enumerate(results):
        label = (r.mode if r.status == OK else f"{r.mode} ({r.status})") + (" (emulated)" if r.emulated else "")
        style = dict(color=colors[i], linestyle=_LINES[i % len(_LINES)], marker=_MARKERS[i % len(_MARKERS)],
                     label=label, linewidth=1.2, markersize=4, alpha=0.9)
        xs, ys = _finite_points(r.loss_curve)
        if xs:
            ax_loss.plot(xs, ys, markevery=spread(len(xs), i), **style)
        xs, ys = _finite_points(r.val_metric_curve)
        if xs:
            ax_val.plot(xs, ys, **style)
        if ax_scale is not None:
            xs, ys = _finite_points(r.scale_curve)
            if xs:
                ax_scale.plot(xs, ys, markevery=spread(len(xs), i), **style)
    base = next((r for r in results if r.mode == BASELINE and r.status == OK and _finite(r.val_metric)), None)
    if base is not None:
        margin = tolerance * abs(base.val_metric)
        low, high = (base.val_metric - margin, base.val_metric) if higher_is_better else \
            (base.val_metric, base.val_metric + margin)
        ax_val.axhspan(low, high, color="0.85", zorder=0, label=f"within {tolerance:.1%} of O0")
        ax_val.axhline(base.val_metric, color="0.4", linewidth=0.8, zorder=0)
    ax_loss.set(title="training loss", xlabel="step", ylabel="loss")
    losses = [v for line in ax_loss.get_lines() for v in line.get_ydata()]
    if losses and min(losses) > 0 and max(losses) > 10 * min(losses):  # log only where it spreads the curves
        ax_loss.set_yscale("log")
    better = "higher" if higher_is_better else "lower"
    ax_val.set(title=f"validation {metric_name} ({better} is better)", xlabel="epoch", ylabel=metric_name)
    ax_val.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax_scale is not None:
        ax_scale.set(title="loss scale (1 = no scaling)", xlabel="step", ylabel="scale")
        ax_scale.set_yscale("log", base=2)
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if not memory:
        fig.text(0.99, 0.985, "peak memory not shown: on a CPU it measures the allocator more than the mode",
                 ha="right", va="top", fontsize=8, color="0.4")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def plot_curves(path: str, results: list[ModeResult], metric_name: str, tolerance: float = 0.02,
                higher_is_better: bool = True) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(results, metric_name, tolerance, higher_is_better)
    fig.savefig(path, dpi=100)
    plt.close(fig)

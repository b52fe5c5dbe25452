"""compare_runs.py's PNG: one panel per metric, one line per run (or per ``--over`` group, with its band)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lit_dtrain.utils.plots import write_atomically

LINE_STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]


def plot(curves: dict[str, dict[str, list[tuple[int, float]]]], metrics: list[str], out: Path, title: str = "",
         logy: bool = False, tokens: dict[str, Callable[[float], float]] | None = None,
         spread: dict[str, dict[str, list[float]]] | None = None) -> None:
    """One panel per metric, one line per run; ``curves[label][metric] = [(step, value), ...]``, each point at the
    steps trained when it was measured (:func:`at_steps_trained`). ``tokens``: each run's tokens trained after a
    number of steps (:func:`tokens_trained`), to draw it against the tokens trained then (``--x tokens``).
    ``spread``: a band of that width either side of each point (``--over``: a group's standard deviation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(6.4 * len(metrics), 4.4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, (label, tags) in enumerate(curves.items()):
            series = tags.get(metric) or []
            if series:
                steps, values = zip(*series)
                if tokens:
                    steps = [tokens[label](step) for step in steps]
                # the colour cycle has 10 entries: runs 10-19, 20-29, ... get another line style
                ax.plot(steps, values, label=label, marker="." if len(steps) < 60 else None, linewidth=1.3,
                        color=f"C{i % 10}", linestyle=LINE_STYLES[i // 10 % len(LINE_STYLES)])
                if spread:
                    width = spread[label][metric]
                    ax.fill_between(steps, [v - w for v, w in zip(values, width)],
                                    [v + w for v, w in zip(values, width)], color=f"C{i % 10}", alpha=0.2, linewidth=0)
                    if len(steps) == 1:  # a band of one point is not drawn: an error bar
                        ax.errorbar(steps, values, yerr=width, fmt="none", color=f"C{i % 10}", capsize=4)
        ax.set_xlabel("tokens trained" if tokens else "steps trained")
        ax.set_ylabel(metric)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles = {}  # every run once, also one drawn only in a later panel (it lacks the first metric)
    for ax in axes[0]:
        for line in ax.get_lines():
            handles.setdefault(line.get_label(), line)
    order = [label for label in curves if label in handles]
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # below the panels, not inside one: a sweep's labels can be wider than a panel and would hide its curves;
    # bbox_inches="tight" grows the PNG to hold all of it
    axes[0][0].legend([handles[label] for label in order], order, fontsize=7, loc="upper left",
                      bbox_to_anchor=(0, -0.16), borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))
    plt.close(fig)

"""PNG charts shared by the tools: ``memkern bench --plot`` and ``memkern plan --plot``."""
from __future__ import annotations

from collections.abc import Sequence


def stacked_bars(names: Sequence[str], components: Sequence[tuple[str, Sequence[float], str]],
                 marks: Sequence[float], mark_label: str, path: str, title: str) -> None:
    """One stacked bar (MiB) per name: ``components`` are (label, height per name, colour);
    ``marks`` a black tick per bar (a peak), labelled ``mark_label``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 3, 4.5), dpi=110)
    bottoms = [0.0] * len(names)
    for label, heights, color in components:
        ax.bar(names, heights, bottom=bottoms, label=label, color=color)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.scatter(names, marks, marker="_", s=900, color="black", label=mark_label, zorder=3)
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

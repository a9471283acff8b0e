"""Learning-curve PNGs for the examples (matplotlib is an optional extra: ``pip install 'fxapprox[plots]'``)."""

from __future__ import annotations


def save_curves(path: str, curves: dict, *, xlabel: str, ylabel: str, title: str, ylim=None,
                marker: str | None = None) -> bool:
    """Plot ``{label: (xs, ys)}`` to ``path``; returns ``False`` (and says so) without matplotlib.

    Example::

        >>> save_curves("curves.png", {"exact": ([1, 2], [0.9, 0.95])}, xlabel="epoch", ylabel="accuracy",
        ...             title="digits")
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fxapprox[plots]')")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker=marker, markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True

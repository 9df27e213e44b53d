"""matplotlib for the reports' PNGs: no display, each figure closed once
written."""


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported when first needed: only
    the reports plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path, dpi):
    """Writes fig to path (a PNG) and frees it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)

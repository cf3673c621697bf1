"""Rank heat map for `kvrewrite inspect`: kept key/value rank per layer and KV head.

Uses matplotlib's object API with the Agg canvas directly, so it never needs a display and never changes the
global pyplot backend of the process that imports it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.io.atomic_files import atomic_write

# Cells get their rank written in them only up to this grid size; beyond it the numbers become unreadable.
MAX_ANNOTATED_LAYERS = 48
MAX_ANNOTATED_HEADS = 16
_CMAP = "viridis"


def _as_grid(ranks: list[list[int]], head_dim: int, what: str) -> np.ndarray:
    if not ranks or not all(isinstance(row, (list, tuple)) and len(row) > 0 for row in ranks):
        raise InvalidArgumentError(f"{what} ranks must be a non-empty list of per-layer lists of per-head ranks")
    n_heads = len(ranks[0])
    if any(len(row) != n_heads for row in ranks):
        raise InvalidArgumentError(f"{what} ranks must have the same number of KV heads in every layer")
    grid = np.asarray(ranks, dtype=np.int64)
    if grid.min() < 0 or grid.max() > head_dim:
        raise InvalidArgumentError(
            f"{what} ranks must lie in [0, {head_dim}] (head_dim), got {int(grid.min())}..{int(grid.max())}"
        )
    return grid


def plot_rank_heatmap(
    key_ranks: list[list[int]],
    value_ranks: list[list[int]],
    head_dim: int,
    path: Path,
    title: str = "",
) -> Path:
    """Write a keys | values heat map of ranks (rows = layers, 0 at top; columns = KV heads) to `path`.

    The image format follows the suffix of `path` (PNG when it has none). The file is written to a temporary name
    in the same directory and renamed into place, so a reader never sees a partial image.
    """
    if head_dim < 1:
        raise InvalidArgumentError(f"head_dim must be >= 1, got {head_dim}")
    keys = _as_grid(key_ranks, head_dim, "key")
    values = _as_grid(value_ranks, head_dim, "value")
    if keys.shape != values.shape:
        raise InvalidArgumentError(
            f"key ranks are {keys.shape[0]}x{keys.shape[1]} (layers x heads) but value ranks are "
            f"{values.shape[0]}x{values.shape[1]}; both must cover the same layers and heads"
        )
    n_layers, n_heads = keys.shape
    annotate = n_layers <= MAX_ANNOTATED_LAYERS and n_heads <= MAX_ANNOTATED_HEADS

    kept = int(keys.sum() + values.sum())
    full = 2 * keys.size * head_dim
    # Two lines so a long model name never pushes the kept share off a narrow figure.
    summary = f"KV cache kept: {kept / full:.1%} ({kept:,} of {full:,} dims, head_dim {head_dim})"
    heading = f"{title}\n{summary}" if title else summary

    # Size the figure from the grid so cells stay roughly square and labels legible.
    panel_w = min(max(0.55 * n_heads, 2.8), 9.0)
    fig_h = min(max(0.3 * n_layers, 3.0), 20.0) + 1.6
    fig = Figure(figsize=(2 * panel_w + 2.2, fig_h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    norm = Normalize(vmin=0, vmax=head_dim)
    image = None
    for ax, grid, name in zip(axes, (keys, values), ("keys", "values")):
        image = ax.imshow(grid, cmap=_CMAP, norm=norm, aspect="auto", interpolation="nearest")
        share = grid.sum() / (grid.size * head_dim)
        ax.set_title(f"{name} (kept {share:.1%})")
        ax.set_xlabel("KV head")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n_heads, 16)))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n_layers, 50)))
        if annotate:
            font = 8 if n_layers <= 32 else 6
            for layer in range(n_layers):
                for head in range(n_heads):
                    r = int(grid[layer, head])
                    # Dark text on the bright end of viridis, light text on the dark end.
                    color = "black" if r > 0.6 * head_dim else "white"
                    ax.text(head, layer, str(r), ha="center", va="center", fontsize=font, color=color)
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes), label="kept rank", shrink=0.9)
    fig.suptitle(heading)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix.lstrip(".").lower() or "png"
    atomic_write(path, lambda f: fig.savefig(f, format=fmt))
    return path

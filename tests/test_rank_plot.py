"""Tests for kvrewrite.publish.rank_plot."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from matplotlib import colormaps

from kvrewrite.errors import InvalidArgumentError
from kvrewrite.publish.rank_plot import plot_rank_heatmap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _ranks(n_layers: int, n_heads: int, head_dim: int, offset: int) -> list[list[int]]:
    return [[(7 * layer + 5 * head + offset) % (head_dim + 1) for head in range(n_heads)] for layer in range(n_layers)]


def test_writes_valid_png_for_30x3_grid(tmp_path: Path) -> None:
    keys, values = _ranks(30, 3, 64, 0), _ranks(30, 3, 64, 11)
    out = tmp_path / "plots" / "ranks.png"
    result = plot_rank_heatmap(keys, values, 64, out, title="SmolLM2-135M")
    assert result == out
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    image = mpimg.imread(out)
    height, width = image.shape[:2]
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    # The figure is sized from the grid: 30 layers make it taller than wide, and big enough to read.
    assert height > width > 400
    assert sorted(p.name for p in out.parent.iterdir()) == ["ranks.png"]  # no temp file left


def _cell_centres(image: np.ndarray, rank: int, head_dim: int) -> list[tuple[float, float]]:
    """(x, y) centres of the image regions painted in viridis(rank / head_dim): columns where at least 30 pixels
    have that colour (the colour bar's strip of one colour is a few pixels tall), grouped into runs."""
    colour = np.asarray(colormaps["viridis"](rank / head_dim)[:3])
    match = (np.abs(image[..., :3] - colour) < 2 / 255).all(-1)
    columns = np.flatnonzero(match.sum(0) >= 30)
    runs = np.split(columns, np.flatnonzero(np.diff(columns) > 1) + 1) if columns.size else []
    centres = []
    for run in runs:
        ys = np.flatnonzero(match[:, run].any(1))
        ys = ys[match[ys][:, run].sum(1) >= len(run) // 2]  # rows that belong to the cell, not to stray pixels
        centres.append((run.mean(), ys.mean()))
    return centres


def test_cells_show_their_ranks_in_place(tmp_path: Path) -> None:
    """Each rank of a 2 x 2 grid appears as a block of its colour-map colour, at its layer (0 on top) and head
    (0 left), keys left of values: a heat map with rows or panels swapped or the wrong colour scale fails."""
    head_dim = 16
    keys, values = [[0, 4], [8, 12]], [[16, 2], [6, 10]]
    image = mpimg.imread(plot_rank_heatmap(keys, values, head_dim, tmp_path / "r.png"))
    found = {}
    for panel, grid in (("keys", keys), ("values", values)):
        for layer in range(2):
            for head in range(2):
                centres = _cell_centres(image, grid[layer][head], head_dim)
                assert len(centres) == 1, (panel, layer, head, centres)  # one block of exactly that colour
                found[panel, layer, head] = centres[0]
    for panel in ("keys", "values"):
        for head in range(2):
            assert found[panel, 0, head][1] < found[panel, 1, head][1]  # layer 0 above layer 1
        for layer in range(2):
            assert found[panel, layer, 0][0] < found[panel, layer, 1][0]  # head 0 left of head 1
    assert max(x for (p, _, _), (x, _) in found.items() if p == "keys") < min(
        x for (p, _, _), (x, _) in found.items() if p == "values"
    )


def test_large_grid_without_annotations(tmp_path: Path) -> None:
    out = plot_rank_heatmap(_ranks(80, 32, 128, 0), _ranks(80, 32, 128, 3), 128, tmp_path / "big.png")
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_overwrites_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "r.png"
    out.write_bytes(b"old")
    plot_rank_heatmap([[1, 2]], [[3, 4]], 4, out)
    assert out.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("keys", "values", "head_dim"),
    [
        ([], [], 4),  # empty
        ([[1, 2], [1]], [[1, 2], [1, 2]], 4),  # ragged
        ([[5]], [[1]], 4),  # rank above head_dim
        ([[-1]], [[1]], 4),  # negative rank
        ([[1, 2]], [[1]], 4),  # keys and values disagree in shape
        ([[1]], [[1]], 0),  # bad head_dim
    ],
)
def test_bad_input_raises(tmp_path: Path, keys: list[list[int]], values: list[list[int]], head_dim: int) -> None:
    with pytest.raises(InvalidArgumentError):
        plot_rank_heatmap(keys, values, head_dim, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()

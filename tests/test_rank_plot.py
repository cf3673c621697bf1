"""Tests for kvrewrite.publish.rank_plot."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import pytest

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

"""``portable_attention.plot``: heatmaps of any backend's weights, rendered to PNG (Agg)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from portable_attention import attend, plot  # noqa: E402

from conftest import requires_backend  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    yield
    plt.close("all")


def _weights(*lead: int, lq: int = 4, lk: int = 5) -> np.ndarray:
    """Real softmax weights [*lead, lq, lk] of a causal attention (float32)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((*lead, lq, 8), dtype=np.float32)
    k = rng.standard_normal((*lead, lk, 8), dtype=np.float32)
    if not lead:
        q, k = q[None], k[None]
    _, w = attend(q, k, k, causal=True, return_weights=True)
    w = np.asarray(w)
    return w if lead else w[0]


def _saved(figure: Figure, path: Path) -> np.ndarray:
    figure.savefig(path)
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[-1] in (3, 4)
    return np.asarray(image)


def _images(figure: Figure) -> list[Axes]:
    """The heatmap axes of a figure (visible, with an image), without colour bars."""
    return [
        a for a in figure.axes if a.get_visible() and a.images and a.get_label() != "<colorbar>"
    ]


def test_one_heatmap_with_labels(tmp_path: Path) -> None:
    w = _weights()
    queries, keys = ["I", "like", "green", "tea"], ["<s>", "I", "like", "green", "tea"]
    ax = plot.heatmap(w, query_labels=queries, key_labels=keys, title="causal")
    assert isinstance(ax, Axes)
    (image,) = ax.images
    np.testing.assert_array_equal(np.asarray(image.get_array()), w.astype(np.float64))
    assert image.get_clim() == (0.0, pytest.approx(float(w.max())))
    assert [t.get_text() for t in ax.get_yticklabels()] == queries
    assert [t.get_text() for t in ax.get_xticklabels()] == keys
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("causal", "key", "query")
    assert len(ax.figure.axes) == 2  # the heatmap and its colour bar
    pixels = _saved(ax.figure, tmp_path / "one.png")
    assert pixels.shape[0] > 50 and pixels.std() > 0.05


def test_draws_into_a_given_axes_without_colorbar() -> None:
    figure, given = plt.subplots()
    w = _weights()
    ax = plot.heatmap(w, ax=given, colorbar=False, cmap="magma", vmin=0.0, vmax=1.0)
    assert ax is given and figure.axes == [given]
    assert ax.images[0].get_cmap().name == "magma"
    assert ax.images[0].get_clim() == (0.0, 1.0)


def test_grid_of_heads(tmp_path: Path) -> None:
    w = _weights(2, 3)  # [B, H, Lq, Lk]
    figure = plot.heatmap(w, title="all heads")
    assert isinstance(figure, Figure)
    axes = _images(figure)
    assert len(axes) == 6
    for ax, (b, h) in zip(axes, np.ndindex(2, 3), strict=True):
        assert ax.get_title() == f"batch {b}, head {h}"
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), w[b, h])
        assert ax.images[0].get_clim() == (0.0, pytest.approx(float(w.max())))  # one scale
    assert figure.get_suptitle() == "all heads"
    _saved(figure, tmp_path / "grid.png")


def test_grid_hides_the_unused_cells() -> None:
    w = _weights(5)  # [H=5, Lq, Lk]: a 2 x 4 grid with 3 cells left over
    figure = plot.heatmap(w, colorbar=False)
    assert [a.get_title() for a in _images(figure)] == [f"head {h}" for h in range(5)]
    assert sum(not a.get_visible() for a in figure.axes) == 3


def test_one_head_by_index_or_tuple() -> None:
    w = _weights(2, 3)
    ax = plot.heatmap(w, head=(1, 2))
    assert isinstance(ax, Axes) and ax.get_title() == "batch 1, head 2"
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), w[1, 2])
    ax = plot.heatmap(w, head=4)  # row-major over the leading axes: (1, 1)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), w[1, 1])
    ax = plot.heatmap(w, head=-1)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), w[1, 2])


def test_side_by_side_shares_one_scale(tmp_path: Path) -> None:
    w = _weights(2, 3)
    half = w / 2
    figure = plot.side_by_side({"numpy": w, "halved": half}, head=(0, 1), title="compare")
    axes = _images(figure)
    assert [a.get_title() for a in axes] == ["numpy", "halved"]
    np.testing.assert_array_equal(np.asarray(axes[1].images[0].get_array()), half[0, 1])
    assert axes[0].images[0].get_clim() == axes[1].images[0].get_clim()
    assert figure.get_suptitle() == "compare"
    _saved(figure, tmp_path / "side.png")


#: The report's title of its default plot case (``python -m portable_attention --plot``).
LONG_TITLE = (
    "window (float32): sliding window: causal=True, window=(4, 0) "
    "(each query sees itself and 4 before)"
)


def _titles_inside(figure: Figure, path: Path) -> list[Any]:
    """Save ``figure`` and check that every title drawn lies inside it; returns the title
    ``Text`` objects (the figure's first)."""
    figure.savefig(path)  # draws: layout done, wrapped titles measured as drawn
    box = figure.bbox
    texts = [t for t in (*figure.texts, *(a.title for a in figure.axes)) if t.get_text()]
    for text in texts:
        extent = text.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, (text.get_text(), extent, box)
        assert box.y0 <= extent.y0 and extent.y1 <= box.y1, (text.get_text(), extent, box)
    return texts


def _lines(text: Any) -> float:
    """About how many lines ``text`` took when drawn (its height over its font size)."""
    return text.get_window_extent().height / (text.get_fontsize() * text.figure.dpi / 72)


def test_long_figure_title_fits_one_panel_and_grids(tmp_path: Path) -> None:
    """A figure title wider than the figure (the report's, on one backend: it was cut off
    at both sides) is broken into lines at spaces, every word kept."""
    w = _weights(2, 3, lq=16, lk=16)
    figures = {
        "one panel": plot.side_by_side({"numpy cpu": w}, head=(0, 0), title=LONG_TITLE),
        "two panels": plot.side_by_side({"a": w, "b": w}, head=(0, 0), title=LONG_TITLE),
        "grid": plot.heatmap(w[:1, :2], title=LONG_TITLE),
    }
    for name, figure in figures.items():
        title = _titles_inside(figure, tmp_path / f"{name}.png")[0]
        assert title.get_text().split() == LONG_TITLE.split(), name
    assert "\n" in figures["one panel"].get_suptitle()  # it needed wrapping


def test_long_axes_title_fits_one_heatmap(tmp_path: Path) -> None:
    """One small heatmap with a long title: wrapped when drawn, inside the figure, and
    ``get_title()`` keeps it as given."""
    ax = plot.heatmap(_weights(lq=3, lk=3), title=LONG_TITLE)
    (title,) = _titles_inside(ax.figure, tmp_path / "one.png")
    assert _lines(title) > 2  # wrapped
    assert ax.get_title() == LONG_TITLE
    ax = plot.heatmap(_weights(2, 3), head=(1, 2), title=LONG_TITLE)
    _titles_inside(ax.figure, tmp_path / "head.png")


def test_input_is_not_modified() -> None:
    w = _weights(2)
    before = w.copy()
    plot.heatmap(w)
    np.testing.assert_array_equal(w, before)


# -- other frameworks --------------------------------------------------------------------------


@requires_backend("torch")
def test_torch_weights_with_grad_and_bfloat16() -> None:
    import torch

    w = _weights(2)
    t = torch.from_numpy(w).requires_grad_(True)
    figure = plot.heatmap(t * 1.0)  # a non-leaf tensor in the autograd graph
    np.testing.assert_array_equal(np.asarray(_images(figure)[1].images[0].get_array()), w[1])
    assert t.requires_grad and t.grad is None
    b16 = t.detach().to(torch.bfloat16)
    ax = plot.heatmap(b16, head=0)
    expected = b16[0].float().numpy().astype(np.float64)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), expected)


@requires_backend("jax")
def test_jax_weights_float32_and_bfloat16() -> None:
    import jax.numpy as jnp

    w = _weights(3)
    ax = plot.heatmap(jnp.asarray(w), head=2)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), w[2])
    b16 = jnp.asarray(w).astype(jnp.bfloat16)
    figure = plot.side_by_side({"f32": jnp.asarray(w[0]), "bf16": b16[0]})
    got = np.asarray(_images(figure)[1].images[0].get_array())
    np.testing.assert_array_equal(got, np.asarray(b16[0].astype(jnp.float32), dtype=np.float64))


# -- errors ---------------------------------------------------------------------------------------


def test_label_lengths_must_match() -> None:
    w = _weights()
    with pytest.raises(ValueError, match=r"`query_labels` has 3 labels but the weights have 4"):
        plot.heatmap(w, query_labels=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"`key_labels` has 4 labels but the weights have 5 keys"):
        plot.heatmap(w, key_labels=list("abcd"))


@pytest.mark.parametrize(
    ("weights", "kwargs", "error", "pattern"),
    [
        (np.ones(4), {}, ValueError, r"`weights` must have at least 2 dimensions"),
        (np.ones((0, 3)), {}, ValueError, r"`weights` of shape \[0, 3\] has no query"),
        (np.ones((3, 3)), {"head": 0}, ValueError, r"`head` needs weights with leading"),
        (np.ones((2, 3, 3)), {"head": 2}, ValueError, r"`head=2` is out of range"),
        (np.ones((2, 2, 3, 3)), {"head": (0,)}, ValueError, r"`head=\(0,\)` does not index"),
        (np.ones((2, 3, 3)), {"head": "0"}, TypeError, r"`head` must be an int or a tuple"),
        (np.ones((2, 3, 3)), {"head": True}, TypeError, r"`head` must be an int"),
        (np.ones((65, 2, 2)), {}, ValueError, r"65 heads, more than 64 panels; pass `head=`"),
        ([[0.5, 0.5]], {}, TypeError, r"`weights` must be an array"),
        (np.ones((2, 2), dtype=complex), {}, TypeError, r"`weights` must hold real numbers"),
    ],
)
def test_bad_weights_or_head(
    weights: Any, kwargs: dict[str, Any], error: type, pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        plot.heatmap(weights, **kwargs)


def test_ax_with_a_grid_is_an_error() -> None:
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=r"`ax` takes one heatmap.*grid of 3 heads"):
        plot.heatmap(_weights(3), ax=ax)


def test_side_by_side_errors() -> None:
    with pytest.raises(ValueError, match=r"`weights` is empty"):
        plot.side_by_side({})
    with pytest.raises(ValueError, match=r"`weights` must all have one shape"):
        plot.side_by_side({"a": np.ones((2, 3)), "b": np.ones((3, 3))})
    with pytest.raises(ValueError, match=r"`weights\['a'\]` has shape \[2, 3, 3\]: pass `head=`"):
        plot.side_by_side({"a": np.ones((2, 3, 3))})


def test_missing_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import matplotlib.pyplot` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"pip install 'portable-attention\[plot\]'"):
        plot.heatmap(np.eye(2))


def test_numpy_integer_heads_and_the_drawn_heads_scale() -> None:
    """``head=`` takes NumPy integers; one drawn head is scaled to its own largest weight."""
    w = np.stack([np.full((2, 2), 0.1), np.full((2, 2), 0.9)])
    ax = plot.heatmap(w, head=np.int64(0))
    assert ax.get_title() == "head 0"
    assert ax.images[0].get_clim() == (0.0, 0.1)
    ax = plot.heatmap(_weights(2, 3), head=(np.int32(1), np.int64(2)))
    assert ax.get_title() == "batch 1, head 2"


def test_clear_errors_for_labels_limits_and_side_by_side_lists() -> None:
    w = _weights()
    with pytest.raises(TypeError, match="`key_labels` must be a sequence"):
        plot.heatmap(w, key_labels=(c for c in "abcde"))
    with pytest.raises(ValueError, match=r"`vmin`=1.0 must be below `vmax`=0.5"):
        plot.heatmap(w, vmin=1.0, vmax=0.5)
    with pytest.raises(TypeError, match="`weights` must be a mapping"):
        plot.side_by_side([w])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one label per query"):
        plot.heatmap(w, query_labels=["a"])

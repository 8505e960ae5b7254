"""Attention-weight heatmaps with matplotlib: ``heatmap`` and ``side_by_side``.

Both take the weights of any backend (NumPy, PyTorch, also on a GPU or with
``requires_grad``, JAX, CuPy, array_api_strict; bfloat16 included): they are copied to a
float64 NumPy array first, and the caller's array is never modified. Rows are queries,
columns keys, as in ``attend(..., return_weights=True)``'s ``[..., Lq, Lk]``.

matplotlib is an optional dependency: ``pip install 'portable-attention[plot]'``.
Nothing here calls ``plt.show()``; new figures come from ``matplotlib.pyplot`` (so a
notebook shows them and ``plt.show()`` works), and saving one needs no display
(``fig.savefig("weights.png")`` works under the "Agg" backend).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from portable_attention import _validate

__all__ = ["heatmap", "side_by_side"]

#: A grid of more heads than this is an error (pass ``head=`` to pick one).
MAX_PANELS = 64

Head = int | tuple[int, ...] | None


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise _validate.matplotlib_missing_error() from exc
    return plt


def _to_numpy(weights: Any, name: str = "weights") -> npt.NDArray[np.float64]:
    from portable_attention import _convert

    try:
        if _convert.dtype_name(getattr(weights, "dtype", None)) == "bfloat16":
            import array_api_compat  # to float32 in its own framework: NumPy has no bfloat16

            xp = array_api_compat.array_namespace(weights)
            weights = xp.astype(weights, xp.float32)
        a = np.asarray(_convert.to_numpy(weights))
    except (TypeError, ValueError) as exc:
        raise _validate.weights_type_error(name, weights, exc) from exc
    if not (np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.bool_)):
        try:  # bfloat16 from JAX arrives as an ml_dtypes extension dtype
            return a.astype(np.float64)
        except (TypeError, ValueError):
            raise _validate.real_weights_error(name, a.dtype) from None
    if np.iscomplexobj(a):
        raise _validate.real_weights_error(name, a.dtype)
    _validate.check_weights_shape(name, a.shape)
    return a.astype(np.float64)


def _pick(a: npt.NDArray[np.float64], head: Head) -> tuple[npt.NDArray[np.float64], str]:
    """The ``[Lq, Lk]`` panel that ``head`` names, and its title."""
    lead = a.shape[:-2]
    head = _validate.check_head(head, a.shape)
    flat = a.reshape(-1, *a.shape[-2:])
    _validate.check_head_index(head, a.shape)
    if isinstance(head, int):
        index = np.unravel_index(head % flat.shape[0], lead)
    else:
        index = tuple(i % n for i, n in zip(head, lead, strict=True))
    return a[tuple(int(i) for i in index)], _title(tuple(int(i) for i in index))


def _title(index: tuple[int, ...]) -> str:
    if len(index) == 1:
        return f"head {index[0]}"
    if len(index) == 2:
        return f"batch {index[0]}, head {index[1]}"
    return f"[{', '.join(map(str, index))}]"


def _draw(
    ax: Any,
    panel: npt.NDArray[np.float64],
    query_labels: Sequence[Any] | None,
    key_labels: Sequence[Any] | None,
    *,
    cmap: str,
    vmin: float | None,
    vmax: float | None,
    title: str | None,
) -> Any:
    image = ax.imshow(panel, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    if key_labels is not None:
        ax.set_xticks(range(len(key_labels)))
        ax.set_xticklabels([str(s) for s in key_labels], rotation=90)
    if query_labels is not None:
        ax.set_yticks(range(len(query_labels)))
        ax.set_yticklabels([str(s) for s in query_labels])
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title)
    return image


def _inches(cells: int) -> float:
    """Panel size for ``cells`` rows or columns: about 0.3 inch a cell, from 2 to 6 inches."""
    return min(6.0, max(2.0, 1.0 + 0.3 * cells))


def _scale(
    data: npt.NDArray[np.float64], vmin: float | None, vmax: float | None
) -> tuple[float, float]:
    """Colour limits shared by every panel: ``[0, max]`` unless given."""
    finite = data[np.isfinite(data)]
    low = 0.0 if vmin is None else vmin
    high = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    return low, high if high > low else low + 1.0


def heatmap(
    weights: Any,
    *,
    query_labels: Sequence[Any] | None = None,
    key_labels: Sequence[Any] | None = None,
    head: Head = None,
    ax: Any = None,
    fig: Any = None,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    colorbar: bool = True,
    title: str | None = None,
) -> Any:
    """Draw attention weights as a heatmap (queries down, keys across).

    Parameters
    ----------
    weights : array ``[Lq, Lk]`` or ``[..., Lq, Lk]``
        Any backend's array, e.g. the weights of ``attend(..., return_weights=True)``.
    query_labels, key_labels : sequence, optional
        Tick labels (tokens), one per query row (``Lq``) and per key column (``Lk``).
    head : int or tuple of ints, optional
        For weights with leading axes: draw only this panel, an index into the leading
        axes (``head=(0, 3)``: batch 0, head 3 of ``[B, H, Lq, Lk]``) or an int counting
        over them all (row-major). ``None`` draws every panel in a grid.
    ax : matplotlib Axes, optional
        Draw the one heatmap here (2-D weights or ``head=`` given); default: a new figure.
    fig : matplotlib Figure, optional
        Draw the grid of heads in this figure; default: a new figure.
    cmap : str
        A matplotlib colormap name.
    vmin, vmax : float, optional
        Colour limits, shared by every panel of a grid; default ``0`` and the largest
        weight drawn (of the one head with ``head=``). ``vmin`` must be below ``vmax``.
    colorbar : bool
        Add a colour bar (one for the whole grid).
    title : str, optional
        The axes title (one heatmap) or the figure title (grid).

    Returns
    -------
    matplotlib.axes.Axes or matplotlib.figure.Figure
        The ``Axes`` of the one heatmap, when ``weights`` is 2-D or ``head`` is given;
        the ``Figure`` holding the grid (one subplot per head, ``fig.axes``) otherwise.
        Each heatmap is the Axes' first image: ``ax.images[0].get_array()`` holds the
        weights drawn.

    Raises
    ------
    ImportError
        matplotlib is not installed.
    TypeError
        ``weights`` is not a real array, or ``head`` is not an int or tuple.
    ValueError
        ``weights`` has fewer than 2 dimensions or is empty, a labels sequence does not
        match ``Lq``/``Lk``, ``head`` is out of range, a grid is asked for with ``ax=``,
        or the grid would have more than :data:`MAX_PANELS` panels.
    """
    plt = _pyplot()
    a = _to_numpy(weights)
    _validate.check_labels(query_labels, a.shape[-2], "query_labels", "queries")
    _validate.check_labels(key_labels, a.shape[-1], "key_labels", "keys")
    _validate.check_color_limits(vmin, vmax)

    if a.ndim == 2 or head is not None:
        panel, panel_title = (a, None) if head is None else _pick(a, head)
        low, high = _scale(panel, vmin, vmax)  # the drawn head's largest weight
        if ax is None:
            _, ax = plt.subplots(
                figsize=(_inches(panel.shape[1]) + 1.5, _inches(panel.shape[0]) + 1.0)
            )
        image = _draw(
            ax,
            panel,
            query_labels,
            key_labels,
            cmap=cmap,
            vmin=low,
            vmax=high,
            title=title or panel_title,
        )
        if colorbar:
            ax.figure.colorbar(image, ax=ax)
        return ax

    _validate.check_grid(a.shape, ax, MAX_PANELS)
    low, high = _scale(a, vmin, vmax)  # one scale for the whole grid
    lead = a.shape[:-2]
    n = math.prod(lead)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    size = (cols * _inches(a.shape[-1]) + 1.0, rows * (_inches(a.shape[-2]) + 0.5) + 0.5)
    if fig is None:
        fig = plt.figure(figsize=size, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for i, index in enumerate(np.ndindex(*lead)):
        cell = axes[i // cols][i % cols]
        image = _draw(
            cell,
            a[index],
            query_labels,
            key_labels,
            cmap=cmap,
            vmin=low,
            vmax=high,
            title=_title(index),
        )
    for extra in axes.flat[n:]:
        extra.set_visible(False)
    if colorbar and image is not None:
        fig.colorbar(image, ax=[c for c in axes.flat[:n]], shrink=0.8)
    if title:
        fig.suptitle(title)
    return fig


def side_by_side(
    weights: Mapping[str, Any],
    *,
    head: Head = None,
    query_labels: Sequence[Any] | None = None,
    key_labels: Sequence[Any] | None = None,
    cmap: str = "viridis",
    title: str | None = None,
) -> Any:
    """Draw several arrays of weights next to each other, one panel each, one colour scale.

    For comparing backends: ``side_by_side({"numpy": w_np, "torch": w_pt})``.

    Parameters
    ----------
    weights : mapping of str to array
        Panel title -> weights, each ``[Lq, Lk]`` (or with leading axes and ``head``);
        all of one shape.
    head : int or tuple of ints, optional
        Which ``[Lq, Lk]`` panel of weights with leading axes to draw (as in
        :func:`heatmap`); required for them.
    query_labels, key_labels, cmap
        As in :func:`heatmap`.
    title : str, optional
        The figure title.

    Returns
    -------
    matplotlib.figure.Figure
        One subplot per entry of ``weights``, in order, and a shared colour bar.

    Raises
    ------
    ImportError, TypeError, ValueError
        As :func:`heatmap`; also an empty ``weights``, arrays of different shapes, or
        leading axes without ``head``.
    """
    plt = _pyplot()
    _validate.check_any_weights(weights)
    panels: dict[str, npt.NDArray[np.float64]] = {}
    for name, w in weights.items():
        a = _to_numpy(w, f"weights[{name!r}]")
        _validate.check_side_panel(name, a.shape, head)
        panels[name] = a if a.ndim == 2 else _pick(a, head)[0]
    shapes = {name: p.shape for name, p in panels.items()}
    _validate.check_same_shapes(shapes)
    lq, lk = next(iter(panels.values())).shape
    _validate.check_labels(query_labels, lq, "query_labels", "queries")
    _validate.check_labels(key_labels, lk, "key_labels", "keys")
    low, high = _scale(np.stack(list(panels.values())), None, None)
    n = len(panels)
    fig = plt.figure(figsize=(n * _inches(lk) + 1.0, _inches(lq) + 1.0), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    image = None
    for cell, (name, panel) in zip(axes, panels.items(), strict=True):
        image = _draw(
            cell, panel, query_labels, key_labels, cmap=cmap, vmin=low, vmax=high, title=name
        )
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    if title:
        fig.suptitle(title)
    return fig

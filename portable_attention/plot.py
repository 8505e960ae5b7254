"""Attention-weight heatmaps with matplotlib: ``heatmap`` and ``side_by_side``.

Both take the weights of any backend (NumPy, PyTorch, also on a GPU or with
``requires_grad``, JAX, CuPy, array_api_strict; bfloat16 included): they are copied to a
float64 NumPy array first, and the caller's array is never modified. Rows are queries,
columns keys, as in ``attend(..., return_weights=True)``'s ``[..., Lq, Lk]``.

matplotlib is an optional dependency: ``pip install 'portable-attention[plot]'``.
Long titles are broken into lines at spaces so that they fit inside the figure: a figure
title to 95% of its width, axes titles when the figure is drawn (matplotlib's ``wrap=True``;
``get_title()`` keeps the text as given). Nothing here calls
``plt.show()``; new figures come from ``matplotlib.pyplot`` (so a notebook shows them and
``plt.show()`` works), and saving one needs no display (``fig.savefig("weights.png")``
works under the "Agg" backend).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from portable_attention._checks import as_int, type_name

__all__ = ["heatmap", "side_by_side"]

#: A grid of more heads than this is an error (pass ``head=`` to pick one).
MAX_PANELS = 64

Head = int | tuple[int, ...] | None


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise _matplotlib_missing_error() from exc
    return plt


def _to_numpy(weights: Any, name: str = "weights") -> npt.NDArray[np.float64]:
    from portable_attention.testing import _convert

    try:
        # bfloat16 (which NumPy has only through ml_dtypes): the converter's exact float64
        half = _convert.dtype_name(getattr(weights, "dtype", None)) == "bfloat16"
        a = np.asarray(_convert.to_numpy(weights, dtype="float64" if half else None))
    except (TypeError, ValueError) as exc:
        raise _weights_type_error(name, weights, exc) from exc
    if not (np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.bool_)):
        try:  # bfloat16 from JAX arrives as an ml_dtypes extension dtype
            return a.astype(np.float64)
        except (TypeError, ValueError):
            raise _real_weights_error(name, a.dtype) from None
    if np.iscomplexobj(a):
        raise _real_weights_error(name, a.dtype)
    _check_weights_shape(name, a.shape)
    return a.astype(np.float64)


def _pick(a: npt.NDArray[np.float64], head: Head) -> tuple[npt.NDArray[np.float64], str]:
    """The ``[Lq, Lk]`` panel that ``head`` names, and its title."""
    lead = a.shape[:-2]
    head = _check_head(head, a.shape)
    flat = a.reshape(-1, *a.shape[-2:])
    _check_head_index(head, a.shape)
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
        ax.set_title(title, wrap=True)  # wrapped when drawn, to fit the figure
    return image


def _suptitle(fig: Any, title: str) -> None:
    """Make ``title`` the figure title, in lines at most 95% of the figure's width.

    Broken at spaces (inside a word only where one word is wider than that), measured with
    the title's font: the figure's width is fixed, so this holds once it is drawn. The title
    also wraps when drawn (``wrap=True``), should the figure be resized.
    """
    text = fig.suptitle(title)
    width = 0.95 * fig.bbox.width
    measured = text.get_window_extent().width
    lines = title.splitlines() or [title]
    chars = max(1, int(max(len(line) for line in lines) * width / measured))
    while measured > width and chars > 1:
        text.set_text("\n".join(textwrap.fill(line, chars) for line in lines))
        measured = text.get_window_extent().width
        chars = max(1, chars - max(1, chars // 20))
    text.set_wrap(True)


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
        The axes title (one heatmap) or the figure title (grid); broken into lines at
        spaces where it would not fit inside the figure.

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
    _check_labels(query_labels, a.shape[-2], "query_labels", "queries")
    _check_labels(key_labels, a.shape[-1], "key_labels", "keys")
    _check_color_limits(vmin, vmax)

    if a.ndim == 2 or head is not None:
        panel, panel_title = (a, None) if head is None else _pick(a, head)
        low, high = _scale(panel, vmin, vmax)  # the drawn head's largest weight
        if ax is None:
            _, ax = plt.subplots(
                figsize=(_inches(panel.shape[1]) + 1.5, _inches(panel.shape[0]) + 1.0),
                layout="constrained",  # room above the axes for a wrapped title
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

    _check_grid(a.shape, ax, MAX_PANELS)
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
        _suptitle(fig, title)
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
        The figure title (broken into lines at spaces where it is wider than 95% of the
        figure).

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
    _check_any_weights(weights)
    panels: dict[str, npt.NDArray[np.float64]] = {}
    for name, w in weights.items():
        a = _to_numpy(w, f"weights[{name!r}]")
        _check_side_panel(name, a.shape, head)
        panels[name] = a if a.ndim == 2 else _pick(a, head)[0]
    shapes = {name: p.shape for name, p in panels.items()}
    _check_same_shapes(shapes)
    lq, lk = next(iter(panels.values())).shape
    _check_labels(query_labels, lq, "query_labels", "queries")
    _check_labels(key_labels, lk, "key_labels", "keys")
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
        _suptitle(fig, title)
    return fig


# -- argument checks and messages of this module ----------------------------------------


def _matplotlib_missing_error() -> ImportError:
    """The error of ``portable_attention.plot`` without matplotlib."""
    msg = (
        "portable_attention.plot needs matplotlib, which is not installed: "
        "pip install 'portable-attention[plot]' (or pip install matplotlib)"
    )
    return ImportError(msg)


def _weights_type_error(name: str, weights: object, err: BaseException) -> TypeError:
    """The error for weights that cannot be converted to NumPy."""
    msg = f"`{name}` must be an array of weights [..., Lq, Lk], got {type(weights).__name__}: {err}"
    return TypeError(msg)


def _real_weights_error(name: str, dtype: object) -> TypeError:
    """The error for weights that do not hold real numbers."""
    msg = f"`{name}` must hold real numbers, got dtype {dtype}"
    return TypeError(msg)


def _check_weights_shape(name: str, shape: tuple[int, ...]) -> None:
    """Weights to draw: at least ``[Lq, Lk]``, neither of them 0."""
    if len(shape) < 2:
        msg = f"`{name}` must have at least 2 dimensions [..., Lq, Lk], got shape {list(shape)}"
        raise ValueError(msg)
    if shape[-1] == 0 or shape[-2] == 0:
        msg = f"`{name}` of shape {list(shape)} has no query or no key to draw"
        raise ValueError(msg)


def _check_labels(labels: Sequence[Any] | None, n: int, name: str, axis: str) -> None:
    """Tick labels: one per query (``axis="queries"``) or key (``axis="keys"``), or None."""
    if labels is not None and not hasattr(labels, "__len__"):
        msg = f"`{name}` must be a sequence of labels (a list or tuple), got {type_name(labels)}"
        raise TypeError(msg)
    if labels is not None and len(labels) != n:
        msg = (
            f"`{name}` has {len(labels)} labels but the weights have {n} {axis} "
            f"(axis {'-2' if axis == 'queries' else '-1'}); pass one label per "
            f"{'query' if axis == 'queries' else 'key'}"
        )
        raise ValueError(msg)


def _check_head(head: object, shape: tuple[int, ...]) -> int | tuple[Any, ...]:
    """``head=`` of the plots: weights of ``shape`` with leading axes, an int or a tuple
    (returned; :func:`_check_head_index` checks that it is in range)."""
    if not shape[:-2]:
        msg = f"`head` needs weights with leading (head) axes; these are 2-D {list(shape)}"
        raise ValueError(msg)
    index = as_int(head)  # NumPy integers too
    if index is not None:
        return index
    sides = tuple(as_int(h) for h in head) if isinstance(head, tuple) else (None,)
    if None in sides:
        msg = f"`head` must be an int or a tuple of ints, got {head!r}"
        raise TypeError(msg)
    return sides


def _check_head_index(head: int | tuple[Any, ...], shape: tuple[int, ...]) -> None:
    """``head=`` (after :func:`_check_head`) indexes the leading axes of ``shape``."""
    lead = shape[:-2]
    panels = math.prod(lead)
    if isinstance(head, int):
        if not -panels <= head < panels:
            msg = (
                f"`head={head}` is out of range for weights {list(shape)}: "
                f"{panels} panels over the leading axes {list(lead)}"
            )
            raise ValueError(msg)
    elif len(head) != len(lead) or not all(
        isinstance(i, int) and -n <= i < n for i, n in zip(head, lead, strict=False)
    ):
        msg = (
            f"`head={head}` does not index the leading axes {list(lead)} of weights "
            f"{list(shape)}; pass one int per leading axis"
        )
        raise ValueError(msg)


def _check_grid(shape: tuple[int, ...], ax: object, max_panels: int) -> None:
    """A grid of every head of weights ``shape``: no ``ax=``, at most ``max_panels``."""
    n = math.prod(shape[:-2])
    if ax is not None:
        msg = (
            f"`ax` takes one heatmap, but weights {list(shape)} with head=None draw a grid "
            f"of {n} heads; pass head=... to draw one, or fig=..."
        )
        raise ValueError(msg)
    if n > max_panels:
        msg = (
            f"weights {list(shape)} have {n} heads, more than {max_panels} panels; "
            "pass `head=` to draw one (or slice the weights first)"
        )
        raise ValueError(msg)


def _check_color_limits(vmin: float | None, vmax: float | None) -> None:
    """``vmin``/``vmax`` of the plots, when both are given: ``vmin < vmax``."""
    if vmin is not None and vmax is not None and not vmin < vmax:
        msg = f"`vmin`={vmin!r} must be below `vmax`={vmax!r}"
        raise ValueError(msg)


def _check_any_weights(weights: object) -> None:
    """``weights`` of ``side_by_side``: a mapping (title -> weights), not empty."""
    from collections.abc import Mapping

    if not isinstance(weights, Mapping):
        msg = (
            f"`weights` must be a mapping of panel title -> weights array (a dict), got "
            f"{type_name(weights)}; e.g. `side_by_side({{'numpy': w_np, 'torch': w_pt}})`"
        )
        raise TypeError(msg)
    if not weights:
        msg = "`weights` is empty: pass a mapping of panel title -> weights array"
        raise ValueError(msg)


def _check_side_panel(name: object, shape: tuple[int, ...], head: object) -> None:
    """One entry of ``side_by_side``: weights with leading axes need ``head=``."""
    if len(shape) > 2 and head is None:
        msg = (
            f"`weights[{name!r}]` has shape {list(shape)}: pass `head=` to pick one [Lq, Lk] panel"
        )
        raise ValueError(msg)


def _check_same_shapes(shapes: dict[str, tuple[int, ...]]) -> None:
    """The panels of ``side_by_side``: all of one shape."""
    if len(set(shapes.values())) > 1:
        msg = f"`weights` must all have one shape, got {shapes}"
        raise ValueError(msg)

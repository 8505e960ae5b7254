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

__all__ = ["heatmap", "side_by_side"]

#: A grid of more heads than this is an error (pass ``head=`` to pick one).
MAX_PANELS = 64

Head = int | tuple[int, ...] | None


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        msg = (
            "portable_attention.plot needs matplotlib, which is not installed: "
            "pip install 'portable-attention[plot]' (or pip install matplotlib)"
        )
        raise ImportError(msg) from exc
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
        kind = type(weights).__name__
        msg = f"`{name}` must be an array of weights [..., Lq, Lk], got {kind}: {exc}"
        raise TypeError(msg) from exc
    if not (np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.bool_)):
        try:  # bfloat16 from JAX arrives as an ml_dtypes extension dtype
            return a.astype(np.float64)
        except (TypeError, ValueError):
            msg = f"`{name}` must hold real numbers, got dtype {a.dtype}"
            raise TypeError(msg) from None
    if np.iscomplexobj(a):
        msg = f"`{name}` must hold real numbers, got dtype {a.dtype}"
        raise TypeError(msg)
    if a.ndim < 2:
        msg = f"`{name}` must have at least 2 dimensions [..., Lq, Lk], got shape {list(a.shape)}"
        raise ValueError(msg)
    if a.shape[-1] == 0 or a.shape[-2] == 0:
        msg = f"`{name}` of shape {list(a.shape)} has no query or no key to draw"
        raise ValueError(msg)
    return a.astype(np.float64)


def _check_labels(labels: Sequence[Any] | None, n: int, name: str, axis: str) -> None:
    if labels is not None and len(labels) != n:
        msg = (
            f"`{name}` has {len(labels)} labels but the weights have {n} {axis} "
            f"(axis {'-2' if axis == 'queries' else '-1'}); pass one label per {axis[:-1]}"
        )
        raise ValueError(msg)


def _pick(a: npt.NDArray[np.float64], head: Head) -> tuple[npt.NDArray[np.float64], str]:
    """The ``[Lq, Lk]`` panel that ``head`` names, and its title."""
    lead = a.shape[:-2]
    if not lead:
        msg = f"`head` needs weights with leading (head) axes; these are 2-D {list(a.shape)}"
        raise ValueError(msg)
    if isinstance(head, bool) or not isinstance(head, int | tuple):
        msg = f"`head` must be an int or a tuple of ints, got {head!r}"
        raise TypeError(msg)
    flat = a.reshape(-1, *a.shape[-2:])
    if isinstance(head, int):
        if not -flat.shape[0] <= head < flat.shape[0]:
            msg = (
                f"`head={head}` is out of range for weights {list(a.shape)}: "
                f"{flat.shape[0]} panels over the leading axes {list(lead)}"
            )
            raise ValueError(msg)
        index = np.unravel_index(head % flat.shape[0], lead)
    else:
        if len(head) != len(lead) or not all(
            isinstance(i, int) and -n <= i < n for i, n in zip(head, lead, strict=False)
        ):
            msg = (
                f"`head={head}` does not index the leading axes {list(lead)} of weights "
                f"{list(a.shape)}; pass one int per leading axis"
            )
            raise ValueError(msg)
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
        Colour limits, shared by every panel; default ``0`` and the largest weight.
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
    _check_labels(query_labels, a.shape[-2], "query_labels", "queries")
    _check_labels(key_labels, a.shape[-1], "key_labels", "keys")
    low, high = _scale(a, vmin, vmax)

    if a.ndim == 2 or head is not None:
        panel, panel_title = (a, None) if head is None else _pick(a, head)
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

    if ax is not None:
        msg = (
            f"`ax` takes one heatmap, but weights {list(a.shape)} with head=None draw a grid "
            f"of {math.prod(a.shape[:-2])} heads; pass head=... to draw one, or fig=..."
        )
        raise ValueError(msg)
    lead = a.shape[:-2]
    n = math.prod(lead)
    if n > MAX_PANELS:
        msg = (
            f"weights {list(a.shape)} have {n} heads, more than {MAX_PANELS} panels; "
            "pass `head=` to draw one (or slice the weights first)"
        )
        raise ValueError(msg)
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
    if not weights:
        msg = "`weights` is empty: pass a mapping of panel title -> weights array"
        raise ValueError(msg)
    panels: dict[str, npt.NDArray[np.float64]] = {}
    for name, w in weights.items():
        a = _to_numpy(w, f"weights[{name!r}]")
        if a.ndim > 2 and head is None:
            msg = (
                f"`weights[{name!r}]` has shape {list(a.shape)}: pass `head=` to pick one "
                "[Lq, Lk] panel"
            )
            raise ValueError(msg)
        panels[name] = a if a.ndim == 2 else _pick(a, head)[0]
    shapes = {name: p.shape for name, p in panels.items()}
    if len(set(shapes.values())) > 1:
        msg = f"`weights` must all have one shape, got {shapes}"
        raise ValueError(msg)
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
        fig.suptitle(title)
    return fig

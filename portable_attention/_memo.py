"""The call memo of ``attend``: a repeated call skips validation and planning.

A call is determined (for validation and for the plan) by its array types, shapes,
dtypes and devices and by its option values with their types; never by data. The memo
maps that key to what was built for it (the :class:`~portable_attention._spec.Call` and
its runner), one table per type of ``q``: ``torch.compile`` traces the lookup and
cannot compare other frameworks' keys (NumPy dtypes) with its own.

Nothing here catches exceptions: an option that cannot be part of a key (a list as
``window``, a tensor as ``scale``, which hashes by identity but can change in place) is
detected by its type, and that call is validated in full and not memoised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from portable_attention import _spec
from portable_attention.backends import adapter

#: Entries per array type. When a full table takes a new entry, its oldest quarter goes
#: (insertion order). A hit only reads: it must stay traceable by ``torch.compile``,
#: which cannot reorder a global dict inside a graph, so the order is not refreshed.
MAX_ENTRIES = 4096

#: Option values that may enter a key: builtin immutables, compared with their type
#: (``causal=1`` must not hit the entry of ``causal=True``).
_KEYABLE = frozenset({bool, int, float, str, type(None)})

_tables: dict[type, dict[Any, Any]] = {}


def _generic_key(get_device: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    def key(x: Any) -> tuple[Any, ...]:
        return (x.shape, x.dtype, _spec.hashable_device(get_device(x)))

    return key


def _generic_qkv_key(get_device: Callable[[Any], Any]) -> Callable[[Any, Any, Any], Any]:
    one = _generic_key(get_device)

    def key(q: Any, k: Any, v: Any) -> tuple[Any, ...]:
        return (type(k), type(v), *one(q), *one(k), *one(v))

    return key


#: By array type, filled by :func:`register` once a type has been validated.
_keys: dict[type, Callable[[Any], tuple[Any, ...] | None]] = {}
_qkv_keys: dict[type, Callable[[Any, Any, Any], tuple[Any, ...] | None]] = {}


def register(call: _spec.Call, *arrays: Any) -> None:
    """Learn the key getters of the (validated) arrays' types. Not while a compiler
    traces: the arrays may be its own (torch.export's fake tensors), whose shapes may be
    symbolic and cannot enter a key; such calls are validated and planned each time."""
    framework = adapter(call.backend)
    if framework.tracing():
        return
    one, qkv = framework.memo_keys() or (
        _generic_key(framework.device),
        _generic_qkv_key(framework.device),
    )
    for x in arrays:
        t = type(x)
        if x is None or t in _keys or not _spec.is_registered(t):
            continue
        _keys[t] = one
        _qkv_keys[t] = qkv


def _option_types(options: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The options' types, sides of tuples included; None if one may not enter a key."""
    types: list[Any] = []
    for option in options:
        t = type(option)
        if t is tuple:
            sides = tuple(map(type, option))
            if not _KEYABLE.issuperset(sides):
                return None
            types.append(sides)
        elif t in _KEYABLE:
            types.append(t)
        else:
            return None
    return tuple(types)


def key(q: Any, k: Any, v: Any, mask: Any, bias: Any, options: tuple[Any, ...]) -> Any:
    """The key that determines the call of these arguments, given the type of ``q``
    (one table per type), or None: an array type not yet validated, or an option that
    may not enter a key. Types come first, so a lookup never compares values of other
    types. The flat getter of q, k and v gives what the getters of each would: which
    one runs depends only on the types, which are part of the key."""
    types = _option_types(options)
    if types is None:
        return None
    t = type(q)
    if type(k) is t and type(v) is t:  # one flat getter for the three (the hot path)
        qkv = _qkv_keys.get(t)
        flat = None if qkv is None else qkv(q, k, v)
        if flat is None:
            return None
        parts: list[Any] = [types, options, flat]
    else:  # mixed types (a traced q, a Parameter k, another framework): one getter each
        arrays: list[Any] = [type(k), type(v)]
        for x in (q, k, v):
            one = _keys.get(type(x))
            got = None if one is None else one(x)
            if got is None:
                return None
            arrays.extend(got)
        parts = [types, options, tuple(arrays)]
    for x in (mask, bias):
        if x is None:
            parts.append(None)
            continue
        one = _keys.get(type(x))
        got = None if one is None else one(x)
        if got is None:
            return None
        parts.append((type(x), got))
    return tuple(parts)


def get(table_type: type, key: Any) -> Any:
    """The entry of ``key`` (None for no key or no entry)."""
    if key is None:
        return None
    table = _tables.get(table_type)
    return None if table is None else table.get(key)


def put(table_type: type, key: Any, entry: Any) -> None:
    """Keep ``entry`` for ``key``; a full table drops its oldest entry first."""
    table = _tables.setdefault(table_type, {})
    if len(table) >= MAX_ENTRIES:
        # The oldest quarter goes at once, so the copy of the keys is paid once per
        # MAX_ENTRIES // 4 misses (a decode loop whose Lk grows misses on every step).
        # list(table) copies the keys atomically (another thread may insert meanwhile,
        # which would break an iterator), and pop tolerates a key another thread took.
        for oldest in list(table)[: len(table) - MAX_ENTRIES + max(1, MAX_ENTRIES // 4)]:
            table.pop(oldest, None)
    table[key] = entry


def clear() -> None:
    """Forget every entry (tests; a process that changes its frameworks' state)."""
    _tables.clear()

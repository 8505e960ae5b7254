"""Array-API libraries that array-api-compat knows but whose arrays ``attend`` refuses,
each with the reason and what to pass instead (tried with the real libraries; see
docs/export.md, "Other array-API libraries").

- pydata ``sparse``: its namespace lacks what the mask builders and the band need
  (``arange``), and attention's scores, weights and output are dense whatever the input:
  the sparse format would buy nothing.
- ``marray``: its masked elements count as zeros in its products and sums, so a masked
  key would still be attended (score 0, a positive weight): its mask is not attention's.
"""

from __future__ import annotations

from typing import Any

from portable_attention._checks import backend_name, shape_of, type_name
from portable_attention.backends.generic import GenericAdapter

#: Library name (``_checks.backend_name``) -> why its arrays are refused, and the fix;
#: ``{name}`` is the argument.
REASONS = {
    "sparse": (
        "a pydata sparse array: attention's scores, weights and output are dense whatever "
        "the input, and the library lacks what attend builds its masks with (`arange`); "
        "pass `{name}.todense()` (a NumPy array)"
    ),
    "marray": (
        "a marray masked array, whose masked elements count as zeros in products and sums: "
        "a masked key would still be attended (score 0, a positive weight); pass the "
        "values (`{name}.data`) and the keys each query may attend as `mask=` (boolean, "
        "True = may attend)"
    ),
}


class RefusingAdapter(GenericAdapter):
    """Refuses the arrays of the libraries of :data:`REASONS` with their reason."""

    name = "refused"

    def check_array(self, name: str, x: Any) -> None:
        reason = REASONS.get(backend_name(x))
        if reason is not None:
            msg = (
                f"`{name}` of type {type_name(x)} and shape {shape_of(x)} is "
                f"{reason.format(name=name)}."
            )
            raise TypeError(msg)


ADAPTER = RefusingAdapter()

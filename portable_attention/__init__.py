"""portable_attention: one scaled dot-product attention for NumPy, CuPy, PyTorch and JAX.

Public names only; see :func:`attend`, :func:`attend_backward`, :func:`plan` and
:mod:`portable_attention.masks`.
"""

from portable_attention import backends, masks, mha
from portable_attention._attention import attend, attend_backward, plan
from portable_attention._blockwise import Grads
from portable_attention._plan import Plan

backends.preload()

__all__ = ["Grads", "Plan", "attend", "attend_backward", "masks", "mha", "plan"]
__version__ = "0.1.0"

"""Multi-head attention modules in each framework's own module system.

One submodule per framework, imported on its own so that this package imports no
framework:

* :mod:`portable_attention.nn.torch` — ``MultiHeadAttention``, a ``torch.nn.Module``
  (``from_torch`` / ``to_torch`` and a drop-in ``torch_compat`` form for
  ``torch.nn.MultiheadAttention``);
* :mod:`portable_attention.nn.flax` — ``MultiHeadAttention``, a Flax NNX module
  (``pip install portable-attention[flax]``).

Both hold the parameters of :mod:`portable_attention.mha` (the one state format, the same
names and shapes) and run :func:`portable_attention.mha.multi_head_attention`, so weights
move between them, NumPy, JAX and CuPy unchanged::

    from portable_attention.nn.torch import MultiHeadAttention
"""

__all__: list[str] = []

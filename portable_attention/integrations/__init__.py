"""Integrations of :func:`portable_attention.attend` into other libraries' model code.

Each submodule imports its library only when it is imported itself:

* :mod:`portable_attention.integrations.transformers`: Hugging Face transformers,
  ``register()`` then ``attn_implementation="portable"``.
"""

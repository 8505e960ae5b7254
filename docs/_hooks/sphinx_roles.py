"""MkDocs hook: tidy the reStructuredText the package's docstrings use, in the API page.

The docstrings are written for ``help()`` and Sphinx-style readers (``:func:`attend```,
double-backtick literals). mkdocstrings renders them as Markdown, which leaves the role
prefix (``:func:<code>attend</code>``) and, in the type column, literal double backticks.
This hook drops the role prefixes (and a ``~`` after them) and the stray backticks in the
rendered HTML of the pages that hold ``:::`` directives. It changes no text but those
markers.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|obj|exc):<code>~?")
_TICKS = re.compile(r"``([^`<>]+)``")


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    if "doc-object" not in html:  # only pages rendered by mkdocstrings
        return html
    return _TICKS.sub(r"\1", _ROLE.sub("<code>", html))

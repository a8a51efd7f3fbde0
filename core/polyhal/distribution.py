"""How polyhal and its plugins were installed: their versions (from the distribution metadata,
the one place a version is written) and the ``pip install`` line that adds a missing part.

A hint must name a command that works: from a source checkout (the distribution installed in
editable mode, or not installed while the checkout's folder for it exists) that is
``pip install -e plugins/cuda``; otherwise the distribution's name (``pip install polyhal-cuda``).
Every install hint of the core and the backends comes from :func:`install_hint`.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

__all__ = ["checkout_folder", "install_hint", "version"]

#: The root of the source checkout this polyhal runs from (core/polyhal/ is two levels below it),
#: whether or not it is one: :func:`checkout_folder` checks for the distribution's pyproject.toml.
_CHECKOUT = Path(__file__).resolve().parents[2]


def version(distribution: str = "polyhal") -> str:
    """The installed version of ``distribution``, or ``"unknown"`` where it is not installed
    (a checkout put on ``sys.path`` by hand)."""
    from importlib import metadata  # here, not at import: `import polyhal` stays cheap

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _editable_or_absent(distribution: str) -> bool:
    from importlib import metadata

    try:
        direct_url = metadata.distribution(distribution).read_text("direct_url.json")  # PEP 610
    except metadata.PackageNotFoundError:
        return True
    try:
        return bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return False


def checkout_folder(distribution: str) -> Path | None:
    """The folder of the source checkout that builds ``distribution`` (the root for ``polyhal``,
    ``plugins/NAME`` for ``polyhal-NAME``) when polyhal runs from a checkout and ``distribution``
    is installed from it in editable mode or not at all; else None."""
    folder = _CHECKOUT if distribution == "polyhal" else _CHECKOUT / "plugins" / distribution.removeprefix("polyhal-")
    if not (folder / "pyproject.toml").is_file() or not (_CHECKOUT / "core" / "polyhal").is_dir():
        return None
    return folder if _editable_or_absent(distribution) else None


def install_hint(distribution: str, extra: str | None = None) -> str:
    """The ``pip install`` command that installs ``distribution`` (with the optional ``extra``) the
    way this polyhal was installed, e.g. ``pip install -e plugins/cuda`` from a checkout or
    ``pip install 'polyhal-cuda[cuda13]'`` from an index."""
    folder = checkout_folder(distribution)
    suffix = f"[{extra}]" if extra else ""
    if folder is None:
        return f"pip install {shlex.quote(distribution + suffix)}"
    # Relative to the working directory where that is inside the checkout, as a user types it.
    where = os.path.relpath(folder)
    if where.startswith(".."):
        where = str(folder)
    return f"pip install -e {shlex.quote(where + suffix)}"

"""fissix caches its grammar tables under the user's cache directory (``~/.cache/fissix``) and
fails at import when that cannot be created (``HOME=/dev/null``, a read-only home in a
container). Imported before fissix's grammar is loaded: an unusable cache directory is replaced
by one in the temporary directory, or none (fissix then only fails to save the tables, which it
tolerates)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _usable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def ensure_cache_dir() -> None:
    import fissix

    if _usable(Path(fissix.CACHE_DIR)):
        return
    fallback = Path(tempfile.gettempdir()) / f"adopter-fissix-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    fissix.CACHE_DIR = fallback if _usable(fallback) else Path(tempfile.mkdtemp(prefix="adopter-fissix-"))


ensure_cache_dir()

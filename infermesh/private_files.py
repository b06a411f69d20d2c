"""Where infermesh keeps what only its user may read: the data folder, and files written 0600 atomically."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """``$XDG_DATA_HOME/infermesh`` (default ``~/.local/share/infermesh``), where the ledger lives too."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "infermesh"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by this user only (0600, folder 0700), atomically (a reader sees old or new)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text)
    os.chmod(partial, 0o600)
    os.replace(partial, path)

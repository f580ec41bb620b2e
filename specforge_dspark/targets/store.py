"""Where the targets we build or convert are kept: in place (a folder holding a
`.build_key`, written last, equal to its builder's key is reused as it is) and, by key,
for every clone on this machine (as pip and Hugging Face keep theirs)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

STORE = "SPECFORGE_TINY_STORE"
"""The machine's store: $SPECFORGE_TINY_STORE, else $XDG_CACHE_HOME (or ~/.cache)
/specforge_dspark/tiny; an empty $SPECFORGE_TINY_STORE turns it off."""
MARKER = ".build_key"


def store() -> Path | None:
    if STORE in os.environ:
        return Path(os.environ[STORE]) if os.environ[STORE] else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specforge_dspark" / "tiny"


def holds(path: Path, key: str) -> bool:
    """Whether `path` is a finished build of `key`."""
    marker = path / MARKER
    return marker.is_file() and marker.read_text().strip() == key


def cached(
    out: Path,
    name: str,
    key: str,
    make: Callable[[Path], None],
    force: bool = False,
    log=print,
    label: str = "target",
) -> Path:
    """`out` holding the build `key` of `name`: reused when it does, else copied from the
    store (its folder `name-key`), else made by `make(out)` (which writes MARKER last) and
    kept in the store. One builder at a time per `out` (test workers wait on its lock);
    `label` starts each line logged."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and holds(out, key):
            log(f"{label}: reusing {out} (build key {key})")
            return out
        stored = None if store() is None else store() / f"{name}-{key}"
        if not force and stored is not None and holds(stored, key):
            copy_into(stored, out)
            log(f"{label}: copied the build of key {key} from {stored}")
            return out
        make(out)
        if not holds(out, key):
            raise RuntimeError(f"{label}: the build at {out} wrote no {MARKER} {key}")
        if stored is not None:
            try:  # best effort: a store that cannot be written costs the next clone a build
                stored.parent.mkdir(parents=True, exist_ok=True)
                copy_into(out, stored)
            except OSError as e:
                log(f"{label}: not kept in {stored.parent} ({e})")
    return out


def copy_into(src: Path, out: Path) -> None:
    """`src` copied to `out` whole: a copy that dies half way leaves no target behind."""
    tmp = out.with_name(out.name + ".copy")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)

"""The seed release, decent-optim-wrapper 0.1.1, loaded beside this library for side-by-side timing.

The release has this package's name, so it cannot be installed into the same environment. Install it into
a folder of its own (the release declares Python 3.12 but runs on 3.11; ``--no-deps`` keeps torch out)::

    uv pip install --no-deps --python-version 3.12 --target /tmp/seed-0.1.1 decent-optim-wrapper==0.1.1

and pass that folder (``--seed-path /tmp/seed-0.1.1``). :func:`load_seed_wrapper` imports the release's
modules with the folder first on ``sys.path`` and this library's modules set aside, then puts this
library's modules back: the release's classes keep their own modules (their globals), so both work in one
process.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

PACKAGE = "decent_optim_wrapper"
INSTALL = (
    "uv pip install --no-deps --python-version 3.12 --target DIR decent-optim-wrapper==0.1.1, "
    "then pass --seed-path DIR"
)


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def load_seed_wrapper(path: str | Path) -> Any:
    """The release's ``DecentOptimWrapper`` class from the folder ``path`` (which holds its package)."""
    folder = Path(path)
    if not (folder / PACKAGE / "wrapper.py").is_file():
        raise FileNotFoundError(f"--seed-path {str(path)!r} holds no {PACKAGE}/wrapper.py: {INSTALL}")
    ours = {name: module for name, module in sys.modules.items() if _ours(name)}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        wrapper = importlib.import_module(f"{PACKAGE}.wrapper")
    finally:
        sys.path.remove(str(folder))
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
        sys.modules.update(ours)
    return wrapper.DecentOptimWrapper


def seed_wrapper(seed_class: Any, optimizer: Any, topology: str) -> Any:
    """The release's wrapper over ``optimizer`` on the default process group (one process per node, as
    the release's README starts it on CPUs)."""
    import torch.distributed as dist

    return seed_class(optimizer, dist.get_rank(), dist.get_world_size(), 1, topology)

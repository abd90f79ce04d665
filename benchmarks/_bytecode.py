"""Write the package's bytecode before a benchmark times first calls or command-line runs.

An editable install under ``PYTHONDONTWRITEBYTECODE=1`` (as on this project's machines)
compiles every module a run imports from source, in each process: about 1.5 s of a first
call's import on 2 cores (43 modules, 2026-11-29), which a user who installed the wheel
never pays (pip writes the bytecode at install). ``compileall`` writes the files whatever
that variable says; later imports read them.
"""

from __future__ import annotations

import compileall
from pathlib import Path


def byte_compile_package() -> None:
    """Byte-compile ``taso_jax`` and its ``ops``/``search``/``verify`` packages in place."""
    import taso_jax

    root = Path(taso_jax.__file__).resolve().parent.parent
    for pkg in ("taso_jax", "ops", "search", "verify"):
        if (root / pkg).is_dir():
            compileall.compile_dir(str(root / pkg), quiet=2)

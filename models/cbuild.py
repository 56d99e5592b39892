"""C sources shipped with the package, built by the system's compiler at first use.

Each build lands once per version of its source and flags in a folder under the temp directory
(a build artifact, shared by the processes of one boot), written beside its final name and
renamed, so a process loading it never sees half a file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def built(source: Path, flags: Sequence[str], suffix: str = "") -> Path:
    """The path of `source` built with `flags` (`suffix` ".so" for a library, "" for a program),
    building it first if this version was never built. Raises RuntimeError, saying why, when
    there is no compiler or the build fails."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"edgetp-native-{os.getuid()}"
    target = folder / f"{source.stem}-{digest}{suffix}"
    if target.is_file():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(f"no C compiler (cc or gcc) to build {source.name}")
    folder.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=suffix, dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, str(source), "-o", partial], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"building {source.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target

"""Build the GPU stand-ins (libcuda.so.1, libnccl.so.2) and the sample workload.

``build(out_dir)`` compiles them with the system C compiler and returns the paths;
nothing is rebuilt when the sources have not changed. The workload links against the
stand-ins by soname, with an rpath to ``out_dir``, exactly as a CUDA program links
against the driver.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "standin" / "libcuda.c", HERE / "standin" / "libnccl.c", HERE / "workload.c"]
# -O0: every function keeps its own body at its own address with a push first, as in a
# real driver. (-O2 merges identical bodies and starts leaf functions with a
# lock-prefixed add, an instruction x86 uprobes refuse to probe.)
CFLAGS = ["-O0", "-g", "-fPIC", "-Wall", "-Wno-unused-parameter"]


class BuildError(RuntimeError):
    """No C compiler, or the stand-ins failed to compile."""


def build(out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler: apt-get install gcc libc6-dev (`make setup` does)")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)
                            + " ".join(CFLAGS).encode()).hexdigest()[:16]
    paths = {"libcuda": out / "libcuda.so.1", "libnccl": out / "libnccl.so.2",
             "workload": out / "workload"}
    stamp = out / ".built"
    if stamp.exists() and stamp.read_text() == digest and all(p.exists() for p in paths.values()):
        return paths

    def run(*args: str) -> None:
        r = subprocess.run([cc, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"{' '.join(args)}:\n{r.stderr}")

    run(*CFLAGS, "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(paths["libcuda"]),
        str(SOURCES[0]), "-lpthread")
    run(*CFLAGS, "-shared", "-Wl,-soname,libnccl.so.2", "-o", str(paths["libnccl"]),
        str(SOURCES[1]))
    for link, target in (("libcuda.so", "libcuda.so.1"), ("libnccl.so", "libnccl.so.2")):
        (out / link).unlink(missing_ok=True)
        (out / link).symlink_to(target)
    run("-O2", "-g", "-o", str(paths["workload"]), str(SOURCES[2]), f"-L{out}",
        f"-Wl,-rpath,{out}", "-lcuda", "-lnccl", "-lpthread")
    stamp.write_text(digest)
    return paths


if __name__ == "__main__":
    for k, v in build(sys.argv[1] if len(sys.argv) > 1 else "build/gpu").items():
        print(k, v)

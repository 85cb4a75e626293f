"""Python processes whose threads launch kernels in the ways that test the stack
sampler's thread matching and its stack definitions (tests/test_live_flame.py), on
the stand-in libcuda.so.1 and libttpaths.so (flame_paths.c):

    stack_cases.py LIBCUDA LIBPATHS threads N   N idle Python threads started after the
                                                main thread (its state is the oldest)
    stack_cases.py LIBCUDA LIBPATHS native      one idle Python thread and, on "go", a
                                                native thread (no Python thread state)
    stack_cases.py LIBCUDA LIBPATHS handles N   on "go" and on "again": N kernels of
                                                distinct handles, one launch each

Prints one JSON line when set up ({"ready": ..., the threads' ids}), then reads
commands, one per line, and answers each with a JSON line once done:

    go      main_launch() on the main thread (3 launches of "main_kernel"); with
            "native", also worker_launch() on the Python thread, then 3 launches on
            a native thread; with "handles", launch_all()
    again   launch_all() again ("handles")
    quit    exit
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading

BASE_HANDLE = 0x7E0000  # "handles": kernel i is BASE_HANDLE + 64 * i


class Launcher:
    def __init__(self, libcuda: str, libpaths: str) -> None:
        self.cuda = ctypes.CDLL(libcuda, mode=ctypes.RTLD_GLOBAL)
        self.paths = ctypes.CDLL(libpaths)
        self.cuda.cuInit(0)
        u = ctypes.c_uint
        self.cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u,
                                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.paths.tt_native_thread.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]

    def kernel(self, name: str) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self.cuda.cuModuleGetFunction(ctypes.byref(h), None, name.encode())
        return h

    def launch(self, handle: ctypes.c_void_p | int, n: int = 1) -> None:
        for _ in range(n):
            self.cuda.cuLaunchKernel(handle, 1, 1, 1, 32, 1, 1, 0, None, None, None)


def main_launch(gpu: Launcher) -> None:
    gpu.launch(gpu.kernel("main_kernel"), 3)
    gpu.cuda.cuStreamSynchronize(None)


def worker_launch(gpu: Launcher) -> None:
    gpu.launch(gpu.kernel("worker_kernel"), 3)
    gpu.cuda.cuStreamSynchronize(None)


def launch_all(gpu: Launcher, n: int) -> None:
    for i in range(n):
        gpu.launch(BASE_HANDLE + 64 * i)
    gpu.cuda.cuStreamSynchronize(None)


def main() -> int:
    libcuda, libpaths, case = sys.argv[1:4]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    gpu = Launcher(libcuda, libpaths)
    stop = threading.Event()
    work = threading.Event()
    done = threading.Event()
    idents: dict[str, int] = {}

    def idle() -> None:
        stop.wait()

    def worker() -> None:
        idents["worker"] = threading.get_ident()
        idents["worker_tid"] = threading.get_native_id()
        work.wait()
        if not stop.is_set():
            worker_launch(gpu)
        done.set()
        stop.wait()  # alive while the native thread launches (its stack beside this one's)

    threads = [threading.Thread(target=idle, daemon=True)
               for _ in range(n if case == "threads" else 0)]
    if case == "native":
        threads.append(threading.Thread(target=worker, daemon=True))
    for t in threads:
        t.start()
    while case == "native" and "worker_tid" not in idents:
        threading.Event().wait(0.01)
    print(json.dumps({"ready": case, "threads": len(threads) + 1, **idents}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd == "go":
            main_launch(gpu)
            if case == "native":
                work.set()
                done.wait()
                gpu.paths.tt_native_thread(gpu.kernel("native_kernel"), 3)
        if cmd in ("go", "again") and case == "handles":
            launch_all(gpu, n)  # one line: "again" makes the same stacks as "go"
        print(json.dumps({"done": cmd}), flush=True)
    stop.set()
    work.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())

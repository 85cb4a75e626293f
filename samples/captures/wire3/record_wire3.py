"""Record the wire-v3 captures in this folder with the code that wrote wire v3.

Run from a checkout of the commit before wire v4 (``git worktree add /tmp/v3 d5f8af8^``,
then ``cd /tmp/v3 && python /path/to/record_wire3.py OUT``): the GPU stand-in (20
kernels per step, past the 16 burst slots, so KCOUNT records; graph launches; NCCL) and
the ibverbs stand-in, each with the summary that code computed live. The test
tests/test_old_captures.py replays them with today's code and compares.
"""
import json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from samples.gpu.build import build, build_verbs
from tracer.correlate.connections import TrackerOptions
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun
from tracer.events import wire
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
assert wire.WIRE_VERSION == 3, wire.WIRE_VERSION
tmp = Path("/tmp/v3build")
# GPU: 20 kernels per step (past the 16 burst slots: KCOUNT records), 3 threads, NCCL
paths = build(tmp / "gpu")
w = subprocess.Popen([str(paths["workload"]), "--wait", "--steps", "40", "--kernels", "20",
                      "--threads", "2", "--graph-every", "5", "--nccl"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                     env=dict(os.environ, LD_LIBRARY_PATH=str(Path(paths["libcuda"]).parent)))
assert w.stdout.readline().strip() == "ready"
run = TraceRun(CaptureConfig(pids=[w.pid]), [], TrackerOptions(), record=str(out / "gpu-v3.ttcap"))
run.start()
time.sleep(1.0)
w.stdin.write("go\n"); w.stdin.flush()
assert w.wait(60) == 0
time.sleep(0.5)
run.stop()
(out / "gpu-v3.summary.json").write_text(json.dumps(run.pipeline.gpu.summary(), indent=1))
# ibverbs
vp = build_verbs(tmp / "verbs")
env = dict(os.environ, TT_STANDIN_VERBS_COUNTS=str(tmp / "verbs.json"),
           TT_STANDIN_PROVIDER_COUNTS=str(tmp / "provider.json"))
w = subprocess.Popen([str(vp["workload"]), "--wait", "--steps", "30", "--threads", "2"],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
assert w.stdout.readline().strip() == "ready"
run = TraceRun(CaptureConfig(pids=[w.pid]), [], TrackerOptions(), record=str(out / "verbs-v3.ttcap"))
run.start()
w.stdin.write("go\n"); w.stdin.flush()
assert w.stdout.readline().strip() == "opened"
deadline = time.monotonic() + 20
verbs = run.session.gpu.verbs
while not any(len(p.functions) == 3 for p in list(verbs.providers.values())):
    assert time.monotonic() < deadline
    time.sleep(0.02)
w.stdin.write("go\n"); w.stdin.flush()
assert w.stdout.readline().strip() == "done"
assert w.wait(30) == 0
run.stop()
(out / "verbs-v3.summary.json").write_text(json.dumps(run.pipeline.gpu.summary(), indent=1))
print("ok")

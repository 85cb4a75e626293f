"""Record samples/captures/kserve-grpc.ttcap: the sample KServe v2 gRPC server traced
while tritonclient[grpc] makes a fixed set of calls on one connection (unary with token
counts, a stream, an unknown model). The client's own view of each call goes to
kserve-grpc.expected.json, the ground truth the replay test compares with. Needs root
(BPF); run from the repository root:

    sudo .venv/bin/python -m samples.captures.make_grpc_capture
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc

from samples.launch_grpc import GrpcSampleServer
from tracer.probes.session import CaptureConfig
from tracer.runner import TraceRun

HERE = Path(__file__).resolve().parent
PATH = "/inference.GRPCInferenceService/"


def _inputs(prompt: str, n: int) -> list[tc.InferInput]:
    t = tc.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    m = tc.InferInput("max_tokens", [1], "INT32")
    m.set_data_from_numpy(np.array([n], dtype=np.int32))
    return [t, m]


def main() -> None:
    expected: list[dict] = []
    with GrpcSampleServer(port=8798, args=["--token-rate", "400"]) as server:
        run = TraceRun(CaptureConfig(pids=[server.pid]), [],
                       record=str(HERE / "kserve-grpc.ttcap"))
        run.start()
        c = tc.InferenceServerClient(server.target)
        r = c.infer("tiny-gpt", _inputs("What is the capital of France?", 6), request_id="cap-u1",
                    outputs=[tc.InferRequestedOutput("text_output"),
                             tc.InferRequestedOutput("num_output_tokens")])
        expected.append({"path": PATH + "ModelInfer", "grpc_status": 0, "model": "tiny-gpt",
                         "request_id": "cap-u1",
                         "output_tokens": int(r.as_numpy("num_output_tokens")[0])})
        got: list = []
        done = threading.Event()

        def cb(result, error):
            if result is not None and result.as_numpy("text_output") is not None:
                got.append(result)
            if error is not None or result.get_response().parameters[
                    "triton_final_response"].bool_param:
                done.set()

        c.start_stream(callback=cb)
        c.async_stream_infer("tiny-gpt", _inputs("Once upon a time", 9), request_id="cap-s1")
        done.wait(30)
        c.stop_stream()
        expected.append({"path": PATH + "ModelStreamInfer", "grpc_status": 0,
                         "model": "tiny-gpt", "request_id": "cap-s1", "output_tokens": len(got)})
        try:
            c.infer("gpt-9", _inputs("hi", 2))
        except tc.InferenceServerException as e:
            expected.append({"path": PATH + "ModelInfer", "grpc_status": 5,
                             "status": e.status(), "output_tokens": None})
        c.close()
        time.sleep(0.3)
        run.stop()
    (HERE / "kserve-grpc.expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"{len(expected)} calls recorded")


if __name__ == "__main__":
    main()

"""Start the sample KServe gRPC server as a separate process, like ``samples.launch``
does the HTTP one, and wait until it answers ``ServerLive``."""

from __future__ import annotations

from pathlib import Path

import grpc

from samples.launch import SampleServer


class GrpcSampleServer(SampleServer):
    """``python -m samples.kserve_grpc_server --port PORT ...`` in its own group."""

    def __init__(self, port: int = 8001, args: list[str] | None = None,
                 log: str | Path | None = None, env: dict[str, str] | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        super().__init__(module="samples.kserve_grpc_server", port=port, args=args,
                         health="ServerLive", log=log, env=env, tls=tls)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        # raw bytes, not generated stubs: the caller may have loaded other copies of the
        # inference protos (tritonclient's), which collide with ours in one process
        if self.tls is not None:
            creds = grpc.ssl_channel_credentials(Path(self.tls[0]).read_bytes())
            ch = grpc.secure_channel(self.target, creds,
                                     options=[("grpc.ssl_target_name_override", "localhost")])
        else:
            ch = grpc.insecure_channel(self.target)
        with ch:
            live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                  request_serializer=bytes, response_deserializer=bytes)
            try:
                return live(b"", timeout=1) == b"\x08\x01"  # ServerLiveResponse(live=true)
            except grpc.RpcError:
                return False

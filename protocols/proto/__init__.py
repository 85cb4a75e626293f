"""Generated protobuf modules for the KServe v2 / Triton gRPC inference protocol.

``grpc_predict_v2.proto`` is the source; the ``*_pb2*.py`` files next to it were made
with grpcio-tools 1.81.1 (protobuf gencode 6.33.5) from the repository root by::

    python -m grpc_tools.protoc -Iprotocols/proto --python_out=protocols/proto \\
        --grpc_python_out=protocols/proto protocols/proto/grpc_predict_v2.proto
    sed -i 's/^import grpc_predict_v2_pb2 as/from . import grpc_predict_v2_pb2 as/' \\
        protocols/proto/grpc_predict_v2_pb2_grpc.py

    python -m grpc_tools.protoc -Iprotocols/proto \\
        --descriptor_set_out=protocols/proto/grpc_predict_v2.desc \\
        protocols/proto/grpc_predict_v2.proto

The ``*_pb2*.py`` modules register ``inference.*`` in protobuf's default descriptor
pool, as does every other copy of these protos (tritonclient's, KServe's); two copies
in one process collide. The sample server uses them (its own process); the tracer
must coexist with whatever else is loaded, so it builds its message classes from the
descriptor set ``grpc_predict_v2.desc`` in a private pool: ``messages()``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

DESCRIPTOR_SET = Path(__file__).with_name("grpc_predict_v2.desc")
MESSAGES = ("ModelInferRequest", "ModelInferResponse", "ModelStreamInferResponse")


@lru_cache(maxsize=1)
def messages() -> SimpleNamespace:
    """The KServe v2 message classes (``ModelInferRequest``, ``ModelInferResponse``,
    ``ModelStreamInferResponse``), from a private descriptor pool."""
    fds = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for fd in fds.file:
        pool.Add(fd)
    return SimpleNamespace(**{
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{name}"))
        for name in MESSAGES})

"""HF ``transformers serve`` over HTTPS: its own FastAPI app, run by uvicorn with a
certificate.

``transformers serve`` builds its app and hands it to ``uvicorn.Config(app, host=...,
port=..., log_level=...)``; it has no TLS flag. This harness runs the same command with
uvicorn's ``Config`` given ``ssl_certfile`` and ``ssl_keyfile`` (from ``TT_SSL_CERTFILE``
and ``TT_SSL_KEYFILE``), so the server, its app and its event loop (uvloop when
installed: uvicorn's default) are transformers' and uvicorn's own; only the socket
speaks TLS, through Python's ``ssl`` module (OpenSSL, memory BIOs).

    TT_SSL_CERTFILE=cert.pem TT_SSL_KEYFILE=key.pem \\
        python -m samples.hf.tls_serve MODEL_DIR --port 8443 [transformers serve options]
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    cert, key = os.environ["TT_SSL_CERTFILE"], os.environ["TT_SSL_KEYFILE"]
    base = uvicorn.Config

    class TlsConfig(base):  # type: ignore[misc, valid-type]
        def __init__(self, app: Any, *args: Any, **kw: Any) -> None:
            kw.setdefault("ssl_certfile", cert)
            kw.setdefault("ssl_keyfile", key)
            super().__init__(app, *args, **kw)

    uvicorn.Config = TlsConfig  # type: ignore[misc]
    from transformers.cli.transformers import main as transformers_main

    sys.argv = ["transformers", "serve", *(sys.argv[1:] if argv is None else argv)]
    transformers_main()


if __name__ == "__main__":
    main()

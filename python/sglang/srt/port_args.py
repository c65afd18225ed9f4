"""``PortArgs``: the ZMQ IPC endpoints that connect the tokenizer, scheduler and detokenizer
processes, and the TCP port for ``torch.distributed`` init (re-exported by ``server_args``)."""
from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, List

__all__ = ["PortArgs"]


def _ipc_name() -> str:
    # A fresh temp-file path; ZMQ binds a Unix socket there (it replaces the placeholder file).
    fd, path = tempfile.mkstemp(prefix="sglang-", suffix=".ipc")
    os.close(fd)
    return f"ipc://{path}"


def _free_tcp_port(host: str = "127.0.0.1") -> int:
    # Port 0 lets the OS choose an unused port; it stays free with high probability until used.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class PortArgs:
    """ZMQ endpoints between processes, and the TCP port for ``torch.distributed`` init."""

    tokenizer_ipc_name: str  # TokenizerManager PULL <- detokenizer
    scheduler_input_ipc_name: str  # scheduler rank 0 PULL <- TokenizerManager
    detokenizer_ipc_name: str  # DetokenizerManager PULL <- scheduler
    rpc_ipc_name: str  # engine <-> scheduler control
    metrics_ipc_name: str  # scheduler PUSH of metrics
    nccl_port: int

    @staticmethod
    def init_new(server_args: Any) -> "PortArgs":
        """Fresh ``ipc://`` temp-file endpoints and a free port for this server instance."""
        host = server_args.host if server_args.host not in ("0.0.0.0", "::") else "127.0.0.1"
        try:
            port = _free_tcp_port(host)
        except OSError:
            port = _free_tcp_port("127.0.0.1")
        return PortArgs(
            tokenizer_ipc_name=_ipc_name(),
            scheduler_input_ipc_name=_ipc_name(),
            detokenizer_ipc_name=_ipc_name(),
            rpc_ipc_name=_ipc_name(),
            metrics_ipc_name=_ipc_name(),
            nccl_port=port,
        )

    def ipc_paths(self) -> List[str]:
        """Filesystem paths behind the ``ipc://`` endpoints (for cleanup at shutdown)."""
        names = (self.tokenizer_ipc_name, self.scheduler_input_ipc_name, self.detokenizer_ipc_name,
                 self.rpc_ipc_name, self.metrics_ipc_name)
        return [n[len("ipc://"):] for n in names if n.startswith("ipc://")]

"""``python -m sglang.launch_server [server args]``: serve a model over HTTP.

Without ``--model-path`` the bundled model is served (or, if it is absent, ModelConfig's message
says so). SIGINT and SIGTERM shut down cleanly: uvicorn drains, then every child process (the
schedulers and the detokenizer) is terminated and joined before this process exits; the children
also die with this process if it is killed outright (they set a parent-death signal).
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import List, Optional

from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.model_config import ModelConfig


def _raise_system_exit(signum: int, frame) -> None:
    # Turn SIGTERM into an exception so `finally` blocks (child cleanup) run. uvicorn installs
    # its own handler while serving and re-raises the signal after its graceful shutdown.
    raise SystemExit(0)


def run_server(argv: Optional[List[str]] = None) -> int:
    """Parse args, launch, and serve until a signal; returns the process exit code."""
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    signal.signal(signal.SIGTERM, _raise_system_exit)
    from sglang.srt.entrypoints.http_server import launch_server

    try:
        # Check the model folder here, so that e.g. a missing bundled model is one clear line
        # instead of a child process's traceback.
        ModelConfig.from_path(server_args.model_path, server_args.json_model_override_args)
        launch_server(server_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a child failed to start (with its traceback), or the warmup
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass  # uvicorn re-raises SIGINT after its graceful shutdown; the children are down
    return 0


if __name__ == "__main__":
    sys.exit(run_server())

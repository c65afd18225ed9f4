"""``python -m sglang.launch_server [server args]``: serve a model over HTTP.

Without ``--model-path`` the bundled model is served (or, if it is absent, ModelConfig's message
says so). A port that is already in use is reported before any child process starts or the
model loads. SIGTERM and SIGINT shut down gracefully: new requests get 503, those in flight get
up to ``SGLANG_GRACEFUL_SHUTDOWN_TIMEOUT`` seconds to finish, the rest is aborted, then every
child process (the schedulers and the detokenizer) is stopped before this process exits; the
children also die with this process if it is killed outright (they set a parent-death signal).

``--help`` lists the flags in upstream's groups with each default, ``--version`` prints the
package version; both, and an unknown flag (one line naming it), are answered before torch is
imported (``server_args_cli.ServerArgumentParser``).

Exit codes: 0 after a signal, 1 when the server could not start or stopped itself (port in use,
a child failed, the warmup failed), 2 for bad arguments, configuration or environment values.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import List, Optional

from sglang.srt.configs.bailing_moe_v3 import ConfigError
from sglang.srt.configs.model_config import ModelConfig


def _raise_system_exit(signum: int, frame) -> None:
    # Before serving (while the model loads), turn SIGTERM into an exception so that `finally`
    # blocks (child cleanup) run. While serving, the HTTP server's own handler drains instead.
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
    from sglang.srt.entrypoints.server_lifecycle import graceful_shutdown_timeout

    try:
        graceful_shutdown_timeout()  # a bad value is one line now, not a failure at shutdown
        # Check the model folder here, so that e.g. a missing bundled model is one clear line
        # instead of a child process's traceback.
        ModelConfig.from_path(server_args.model_path, server_args.json_model_override_args)
    except ValueError as e:  # ConfigError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        launch_server(server_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # port in use, a child failed to start (with its traceback), or
        print(f"error: {e}", file=sys.stderr)  # the warmup failed
        return 1
    except KeyboardInterrupt:
        pass  # SIGINT while the model loaded; the children are down
    return 0


def main() -> None:
    """Console entry point: run the server, then exit with its code."""
    code = run_server()
    # Everything is stopped and cleaned up by now. Skip the interpreter's teardown of the
    # loaded modules (seconds with torch loaded), which only delays the exit that a supervisor
    # waiting after its SIGTERM is timing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

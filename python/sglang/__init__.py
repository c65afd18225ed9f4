"""sglang: a compact SGLang-compatible engine for batch-1 serving of hybrid linear-attention MoE models."""
__version__ = "0.1.0"


def __getattr__(name):
    # Engine pulls in torch, zmq and the managers; import it only when asked for.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)

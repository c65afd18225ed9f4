"""How this process runs Triton: compiled, or in the CPU interpreter (``TRITON_INTERPRET=1``,
fixed when triton is first imported, so read once here), and the launch options that follow."""
from __future__ import annotations

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Launch option for kernels whose decode and verify programs must round alike: no mul+add
# contraction chosen differently by the compiler in one and not the other (the interpreter
# runs plain numpy and takes no compiler options).
NO_FP_FUSION = {} if INTERPRETED else {"enable_fp_fusion": False}

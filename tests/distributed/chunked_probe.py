"""Run under torchrun: ``llmft train`` with the chunked loss cut into chunks of 16 tokens.

The chunk size follows the vocabulary (2**24 / vocab tokens), so a tiny model's micro-batch is
one chunk; this shrinks the budget so that the sharded engines run many chunks (and recompute
them in backward) on the tiny model. Arguments: RECIPE [KEY=VALUE ...], as ``llmft train``.
"""

from __future__ import annotations

import os
import sys

from llmft.plan import memory
from llmft.train import train

memory.LOSS_CHUNK_ELEMENTS = 320 * 16

if __name__ == "__main__":
    code = train(sys.argv[1], sys.argv[2:])
    # The run is over (process group destroyed, checkpoint written): leave without the interpreter's
    # teardown, which aborts now and then on a rank of this FSDP2 chunked-loss run (SIGABRT,
    # "terminate called without an active exception"; also on the code before this session, see
    # the closing note). What this probe tests is the step, not the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

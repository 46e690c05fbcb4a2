"""Run under torchrun: ``llmft train`` with the chunked loss cut into chunks of 16 tokens.

The chunk size follows the vocabulary (2**24 / vocab tokens), so a tiny model's micro-batch is
one chunk; this shrinks the budget so that the sharded engines run many chunks (and recompute
them in backward) on the tiny model. Arguments: RECIPE [KEY=VALUE ...], as ``llmft train``.
"""

from __future__ import annotations

import sys

from llmft.job.dist import leave_process
from llmft.plan import memory
from llmft.training.train import train

memory.LOSS_CHUNK_ELEMENTS = 320 * 16

if __name__ == "__main__":
    leave_process(train(sys.argv[1], sys.argv[2:]))  # without the interpreter's teardown (leave_process says why)

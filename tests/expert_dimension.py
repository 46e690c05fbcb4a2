"""A parallel dimension borrowed from another, from outside llmft, laid out as expert parallelism
(``llmft.plan.dims.EXPERT``) is: its ranks are the innermost ranks of ``shard``, and the world, the
data-parallel size and the global batch stay as they are. Importing it registers the record.

Its size is ``LLMFT_TEST_BORROWED_PARALLEL`` (default 1); a real one would read its key
(``distributed.borrowed_parallel``), which the recipe schema does not have.
"""

from __future__ import annotations

import os

from llmft.plan.dims import Dimension, register_dimension

ENV = "LLMFT_TEST_BORROWED_PARALLEL"


def borrowed_ranks(recipe, spec) -> int:
    return int(os.environ.get(ENV, "1"))


RECORD = register_dimension(
    Dimension("xp", "borrow", key="distributed.borrowed_parallel", size="expert_dimension:borrowed_ranks", of="shard")
)

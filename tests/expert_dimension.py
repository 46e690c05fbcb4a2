"""A parallel dimension borrowed from another, from outside llmft: a stand-in for expert
parallelism as torchtitan lays it out (its ranks are the innermost ranks of ``shard``: the world,
the data-parallel size and the global batch stay as they are). Importing it registers the record.

Its size is ``LLMFT_TEST_EXPERT_PARALLEL`` (default 1); a real one would read
``distributed.expert_parallel``, which the recipe schema does not have.
"""

from __future__ import annotations

import os

from llmft.plan.dims import Dimension, register_dimension

ENV = "LLMFT_TEST_EXPERT_PARALLEL"


def expert_ranks(recipe, spec) -> int:
    return int(os.environ.get(ENV, "1"))


RECORD = register_dimension(
    Dimension("ep", "borrow", key="distributed.expert_parallel", size="expert_dimension:expert_ranks", of="shard")
)

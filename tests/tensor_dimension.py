"""A parallel dimension from outside llmft: a stand-in for tensor parallelism, one record and this
module (docs/design.md, "The parallel layout"). Importing it registers the record; nothing inside
llmft names it.

Its ranks share each data-parallel rank's sequences (``split``, like ``sp``) and own their
parameters (``params="own"``: FSDP2 does not shard over it). Its size is
``LLMFT_TEST_TENSOR_PARALLEL`` (default 1) on an engine that runs on several ranks, 1 on one
process; a real one would read its recipe key, ``distributed.tensor_parallel``, which the recipe
schema does not have. No model code: what it shows is that the batch plan, the batch equation, the
memory planner's layout and the world mesh take a new dimension from its record alone.
"""

from __future__ import annotations

import os

from llmft.plan.dims import Dimension, register_dimension

ENV = "LLMFT_TEST_TENSOR_PARALLEL"


def tensor_ranks(recipe, spec) -> int:
    return int(os.environ.get(ENV, "1")) if spec.multi_rank else 1


RECORD = register_dimension(
    Dimension("tp", "split", key="distributed.tensor_parallel", size="tensor_dimension:tensor_ranks", params="own")
)

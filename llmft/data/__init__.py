"""Training data: read records, format and mask them, pack, and order them resumably.

Reading and building (the first process that needs a cache entry):

- ``sources``: ``data.train`` / ``data.eval`` as a list of sources (path or hub id, weight, split, ...)
- ``read``: files, directories, globs, save_to_disk dirs and hub ids -> ``datasets`` tables with locations
- ``records``: the three record shapes and their validation
- ``encode``: records -> token ids and labels (which tokens are targets), chat masking in linear time
- ``rows``: what the cache and the stream share: the tokenizing worker, fatal errors, truncate + pack
- ``pack``: several examples per row, attention kept apart by position ids
- ``shards``: tokenizing a source in shards of records, in worker processes, resumable after a stop
- ``pairs``: preference pairs (``train.objective: dpo/reward``): records, truncation, rows, collation
- ``prompts``: prompt records (``train.objective: grpo``): records, the room for generation, rows that keep
  their record, G completions per prompt (``PromptGroups``), collation
- ``entry``: building one cache entry (tokenize, hold out, rows, eval prompts, write)
- ``cache``: the tokenized-data cache: keys, the build lock, checksums, entries
- ``build``: ``build_data``, from recipe keys to the run's ``DataBundle``
- ``prepare``: ``llmft prepare``

What a rank reads:

- ``tokens``: ``TokenDataset``, a cache entry's rows, memory-mapped
- ``mixture``: several cached sources as one dataset, by weight
- ``stream``: ``data.streaming``, rows read and tokenized block by block, resumable from a cursor
- ``bundle``: ``DataBundle``, the run's data and how its order and position work
- ``sampler``: ``GlobalOrder`` and ``MicroBatchSampler``, resumable from one position
- ``loader``: ``collate``, ``count_targets``, ``batch_targets``, ``make_loader``; ``sequence``: a rank's
  sequence slice of a micro-batch (``distributed.sequence_parallel``); ``workers``: its stop-safe workers
"""

from llmft.data.build import build_data
from llmft.data.bundle import DataBundle
from llmft.data.loader import batch_targets, collate, count_targets, make_loader
from llmft.data.sampler import MicroBatchSampler

__all__ = [
    "DataBundle",
    "MicroBatchSampler",
    "build_data",
    "collate",
    "batch_targets",
    "count_targets",
    "make_loader",
]

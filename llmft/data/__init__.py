"""Training data: read records, format and mask them, pack, and order them resumably.

Reading and building (the first process that needs a cache entry):

- ``sources``: ``data.train`` / ``data.eval`` as a list of sources (path or hub id, weight, split, ...)
- ``read``: files, directories, globs, save_to_disk dirs and hub ids -> ``datasets`` tables with locations
- ``records``: the three record shapes and their validation
- ``encode``: records -> token ids and labels (which tokens are targets), chat masking in linear time
- ``rows``: what the cache and the stream share: the tokenizing worker, fatal errors, truncate + pack
- ``pack``: several examples per row, attention kept apart by position ids
- ``shards``: tokenizing a source in shards of records, in worker processes, resumable after a stop
- ``kinds``: the record-kind registry (``RecordKind``: ``sequences``, ``pairs``, ``prompts``) and one
  module per kind (``kinds/sequences``, ``kinds/pairs``, ``kinds/prompts``): parse, encode, rows, cache
  format, grouping (G completions per prompt), collation
- ``arrays``: ``Example``, ``IGNORE_INDEX`` and the range arithmetic the others share
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

import importlib

# Names are imported when first used (PEP 562), so that ``llmft.data.kinds`` (pure, read by the
# planner) is importable without torch or the build.
_EXPORTS = {
    "DataBundle": "llmft.data.bundle",
    "MicroBatchSampler": "llmft.data.sampler",
    "build_data": "llmft.data.build",
    "collate": "llmft.data.loader",
    "batch_targets": "llmft.data.loader",
    "count_targets": "llmft.data.loader",
    "make_loader": "llmft.data.loader",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmft.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

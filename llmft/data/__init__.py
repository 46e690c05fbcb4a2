"""Training data: read records, format and mask them, pack, and order them resumably.

- ``sources``: ``data.train`` / ``data.eval`` as a list of sources (path or hub id, weight, split, ...)
- ``read``: files, directories, globs, save_to_disk dirs and hub ids -> ``datasets`` tables with locations
- ``records``: the three record shapes and their validation
- ``encode``: records -> token ids and labels (which tokens are targets), chat masking in linear time
- ``pack``: several examples per row, attention kept apart by position ids
- ``cache``: the tokenized-data cache: keys, the build lock, entries
- ``dataset``: ``build_data``, the pipeline from recipe keys to memory-mapped ``TokenDataset`` s
- ``prepare``: ``llmft prepare``
- ``sampler``: ``GlobalOrder`` and ``MicroBatchSampler``, resumable from one position
- ``loader``: ``collate``, ``count_targets``, ``make_loader``
"""

from llmft.data.build import DataBundle, MixedDataset, TokenDataset, build_data
from llmft.data.encode import IGNORE_INDEX
from llmft.data.loader import collate, count_targets, make_loader
from llmft.data.sampler import GlobalOrder, MicroBatchSampler

__all__ = [
    "IGNORE_INDEX",
    "DataBundle",
    "GlobalOrder",
    "MicroBatchSampler",
    "MixedDataset",
    "TokenDataset",
    "build_data",
    "collate",
    "count_targets",
    "make_loader",
]

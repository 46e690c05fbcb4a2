"""Training data: read records, format and mask them, pack, and order them resumably.

- ``read``: files, directories and save_to_disk dirs -> raw JSON values with locations
- ``records``: the three record shapes and their validation
- ``encode``: records -> token ids and labels (which tokens are targets)
- ``pack``: several examples per row, attention kept apart by position ids
- ``dataset``: ``build_data``, the pipeline from recipe keys to ``TokenDataset`` s
- ``sampler``: ``GlobalOrder`` and ``MicroBatchSampler``, resumable from one position
- ``loader``: ``collate``, ``count_targets``, ``make_loader``
"""

from llmft.data.dataset import DataBundle, TokenDataset, build_data
from llmft.data.encode import IGNORE_INDEX
from llmft.data.loader import collate, count_targets, make_loader
from llmft.data.sampler import GlobalOrder, MicroBatchSampler

__all__ = [
    "IGNORE_INDEX",
    "DataBundle",
    "GlobalOrder",
    "MicroBatchSampler",
    "TokenDataset",
    "build_data",
    "collate",
    "count_targets",
    "make_loader",
]

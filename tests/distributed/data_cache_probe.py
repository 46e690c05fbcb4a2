"""Run under torchrun: every rank builds the recipe's data at once; writes what it did to OUT/rank-<R>.json.

Usage: torchrun ... data_cache_probe.py RECIPE OUT
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer
from llmft.job.dist import leave_process, read_env
from llmft.recipe import load_recipe

env = read_env()
dist.init_process_group("gloo")
recipe = load_recipe(sys.argv[1], [])
data = build_data(recipe, byte_tokenizer(), env)
dist.barrier()
report = {
    "built": [e["built"] for e in data.entries],
    "entries": [e["entry"] for e in data.entries],
    "rows": [
        {k: None if v is None else v.tolist() for k, v in data.train[i].items()} for i in range(0, len(data.train), 97)
    ],
}
Path(sys.argv[2], f"rank-{env.rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)

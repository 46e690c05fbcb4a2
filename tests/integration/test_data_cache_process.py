"""The token cache read by another process: a rank maps it with numpy alone."""

import json
import os

from helpers import data_recipe, rows, write_jsonl

import llmft
from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer


def test_a_rank_maps_the_cache_with_numpy_alone_and_the_file_stays_arrow(tmp_path):
    """Opening an entry imports neither pyarrow nor pandas (~66 MiB of RSS per rank); the rows are
    views of one read-only map of the file, which pyarrow (and so datasets) still reads."""
    import subprocess
    import sys

    import pyarrow as pa

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * (i % 7 + 2)} for i in range(40)])
    built = build_data(data_recipe(tmp_path, str(path), packing=True, max_seq_len=16), byte_tokenizer())
    file = built.train.path
    child = (
        "import sys, json; from llmft.data.tokens import TokenDataset; ds = TokenDataset.open(sys.argv[1]); "
        "print(json.dumps([{k: None if v is None else v.tolist() for k, v in ds[i].items()} for i in range(len(ds))])); "
        "print(json.dumps([m for m in ('pyarrow', 'pandas', 'datasets') if m in sys.modules]))"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(llmft.__file__))}
    out = subprocess.run([sys.executable, "-c", child, str(file)], capture_output=True, text=True, check=True, env=env)
    got, imported = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert got == rows(built.train) and imported == []
    assert not built.train._input_ids.flags.writeable and not built.train._input_ids.flags.owndata
    table = pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
    assert table.column("input_ids").to_pylist() == [r["input_ids"] for r in got]

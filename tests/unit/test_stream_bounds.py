"""data.streaming reads a JSONL line of more than a record's bytes a MiB at a time (``read.bounded_lines``):
a 100 MB line is one bad record at file:line (``data.on_bad_record``), the reader's peak memory is
bounded by the limit, not by the line, and the stream resumes exactly past it (its byte cursor)."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from helpers import data_recipe

from llmft.data import build_data, read
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError

HUGE = 100 << 20  # the line's bytes: more than RECORD_MAX_BYTES (64 MiB)


def write_with_a_huge_line(path, before: int = 5, after: int = 12):
    """``before`` short records, one of ``HUGE`` bytes, then ``after`` short ones; the huge line's size."""
    with open(path, "w") as f:
        for i in range(before):
            f.write(json.dumps({"text": f"record {i} before"}) + "\n")
        head = '{"text": "'
        f.write(head)
        f.write("x" * (HUGE - len(head) - 3))  # the line with its newline: HUGE bytes
        f.write('"}\n')
        for i in range(after):
            f.write(json.dumps({"text": f"record {i} after the long line"}) + "\n")
    return HUGE


def stream(tmp_path, path, **data):
    r = data_recipe(tmp_path, str(path), streaming=True, shuffle=False, stream_block=4, max_seq_len=32, **data)
    r.train.max_steps = 10
    return build_data(r, byte_tokenizer()).train


def rows(ds, positions) -> list[tuple]:
    return [(tuple(ds[p]["input_ids"].tolist()), tuple(ds[p]["labels"].tolist())) for p in positions]


def peak_of(fn) -> int:
    """Peak bytes Python allocated while ``fn`` ran (tracemalloc: in this process, no child process)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_100_mb_streamed_line_is_one_bad_record_read_in_bounded_memory(tmp_path):
    path = tmp_path / "train.jsonl"
    size = write_with_a_huge_line(path)
    ds = stream(tmp_path, path, on_bad_record="skip")
    got: list = []
    peak = peak_of(lambda: got.extend(rows(ds, range(34))))  # two passes
    # What the reader holds is bounded by the limit (one readline of RECORD_MAX_BYTES + 1), not by
    # the line: reading it whole, then decoding it, held 2x HUGE (> 200 MB).
    assert peak < read.RECORD_MAX_BYTES + (8 << 20) < 2 * HUGE, peak
    assert ds.stats["skipped"] == 2  # the huge line, in each of the two passes read
    texts = [bytes(ids[1:-1]).decode() for ids, _ in got[:17]]  # byte tokenizer: bos, the bytes, eos
    assert got[17:] == got[:17] and texts == [f"record {i} before" for i in range(5)] + [
        f"record {i} after the long line" for i in range(12)
    ]
    with pytest.raises(UserError) as e:
        stream(tmp_path, path)[5]  # the block holding line 6 is read
    assert str(e.value) == (
        f"{path}:6: is {size - 1} bytes, more than the 64 MiB one record may be "
        "(llmft.limits.RECORD_MAX_BYTES); split it into several records. "
        "Fix or remove the record, or set data.on_bad_record=skip to skip malformed records."
    )


def test_a_stream_resumes_exactly_past_a_100_mb_line(tmp_path):
    path = tmp_path / "train.jsonl"
    write_with_a_huge_line(path, before=3, after=9)
    straight = stream(tmp_path, path, on_bad_record="skip")
    want = rows(straight, range(30))  # 12 rows a pass: two and a half passes
    for at in (4, 7, 14):
        cursor = json.loads(json.dumps(straight.cursor_at(at)))  # as the checkpoint stores it
        resumed = stream(tmp_path, path, on_bad_record="skip")
        resumed.restore(cursor)
        assert rows(resumed, range(at, 30)) == want[at:], at
    # the block after the huge line starts past it: a seek, nothing of the line read again
    before = sum(len(json.dumps({"text": f"record {i} before"})) + 1 for i in range(3))
    assert straight.cursor_at(4)["source"] == {"file": 0, "byte": before + HUGE, "line": 4}


def test_bounded_lines_gives_every_line_or_its_size_and_where_the_next_starts():
    """Against ``split``: random lines around the limit, with and without a last newline."""
    import io
    import random

    rng = random.Random(0)
    for _ in range(300):
        limit = rng.randint(0, 12)
        data = b"".join(rng.choice([b"a", b"bc", b"\n", b"\n\n", b"defghij"]) for _ in range(rng.randint(0, 30)))
        want = data.split(b"\n")
        want = [line + b"\n" for line in want[:-1]] + ([want[-1]] if want[-1] else [])
        f = io.BufferedReader(io.BytesIO(data), buffer_size=8)
        ends, got = [], []
        for lineno, raw, size in read.bounded_lines(f, limit):
            got.append((lineno, raw, size))
            ends.append(f.tell())
        expect = [
            (i + 1, line, len(line)) if len(line.rstrip(b"\n")) <= limit else (i + 1, None, len(line.rstrip(b"\n")))
            for i, line in enumerate(want)
        ]
        assert got == expect, (limit, data)
        assert ends == [sum(map(len, want[: i + 1])) for i in range(len(want))]

"""A fuzzing harness over cache entries (hypothesis): damage a built entry's files, then open it the
way training does (``build_data`` on a cache hit).

Damage: truncation, bit flips, wrong JSON types in ``meta.json``, symlinks (out of the cache, to
another file of the entry, dangling, the entry itself a link), missing files, extra files, a file
replaced by a folder or a FIFO. The property, for every example:

- ``build_data`` returns the rows, eval rows, eval prompts and stats of the undamaged entry (it was
  rebuilt, or the damage touched nothing it reads), or raises a ``UserError`` naming a path in the
  cache dir: never another exception (a traceback), never rows that differ (training on damage);
- within ``EXAMPLE_SECONDS`` (SIGALRM: a hang fails the example instead of the suite);
- nothing outside the cache dir changes (the source data and a folder the symlinks point at).

The default suite runs ``FAST_EXAMPLES`` derandomized examples (~10 s here); ``-m slow`` runs
``SLOW_EXAMPLES`` random ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import as_lists
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmft.data import build_data
from llmft.data.tokenizer import byte_tokenizer
from llmft.errors import UserError
from llmft.recipe.schema import Recipe

FAST_EXAMPLES = 200
SLOW_EXAMPLES = 500
EXAMPLE_SECONDS = 60

FILES = [
    "meta.json",
    "rows.arrow",
    "rows.layout.json",
    "held.arrow",
    "held.layout.json",
    "prompts.arrow",
    "prompts.layout.json",
    "prompts.json",
]
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=8),
    st.lists(st.integers(0, 9), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip


class _Hang(Exception):
    pass


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _arrays(ds) -> tuple:
    return tuple(np.asarray(a).tolist() for a in (ds._input_ids, ds._target, ds._offsets))


class Harness:
    """One built entry (kept pristine), a fresh damaged copy of it per example."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data" / "d.jsonl"
        self.data.parent.mkdir(parents=True)
        self.data.write_text(
            "".join(json.dumps({"prompt": f"q{i}", "completion": "a" * (i % 9 + 1)}) + "\n" for i in range(60))
        )
        self.outside = root / "outside"  # what symlinks point at: must never change
        self.outside.mkdir()
        (self.outside / "file").write_bytes(b"not yours")
        self.tokenizer = byte_tokenizer()
        self.cache = root / "cache"
        first = self.build()
        self.want = self.result(first)
        self.entry = Path(first.entries[0]["entry"])
        assert sorted(p.name for p in self.entry.iterdir()) == sorted(FILES)
        self.pristine = root / "pristine"
        shutil.copytree(self.entry, self.pristine)
        self.untouched = {"data": _snapshot(self.data.parent), "outside": _snapshot(self.outside)}
        self.outcomes: Counter = Counter()  # reused / rebuilt / refused: what the examples exercised

    def recipe(self) -> Recipe:
        r = Recipe()
        r.data.train, r.data.cache_dir, r.data.max_seq_len = str(self.data), str(self.cache), 16
        r.data.packing, r.data.eval_fraction = True, 0.2
        return r

    def build(self):
        return build_data(self.recipe(), self.tokenizer)

    @staticmethod
    def result(data) -> tuple:
        return _arrays(data.train), _arrays(data.eval), as_lists(data.eval_prompts), data.stats

    def reset(self) -> None:
        shutil.rmtree(self.cache)
        self.cache.mkdir()
        shutil.copytree(self.pristine, self.entry)

    def check(self) -> None:
        """The property: the undamaged rows, or a message naming a path in the cache; nothing else changed."""
        previous = signal.signal(signal.SIGALRM, _raise_hang)
        signal.alarm(EXAMPLE_SECONDS)
        try:
            data = self.build()
            assert self.result(data) == self.want, "trained on a damaged entry"
            self.outcomes["rebuilt" if data.entries[0]["built"] else "reused"] += 1
        except UserError as e:
            assert str(self.cache) in str(e), str(e)
            self.outcomes["refused"] += 1
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        assert {"data": _snapshot(self.data.parent), "outside": _snapshot(self.outside)} == self.untouched


def _raise_hang(signum, frame):
    raise _Hang(f"an example took more than {EXAMPLE_SECONDS} s")


@st.composite
def damage(draw) -> tuple:
    kind = draw(st.sampled_from(["truncate", "flip", "meta_type", "symlink", "missing", "extra", "folder", "fifo"]))
    name = draw(st.sampled_from(FILES))
    if kind == "truncate":
        return kind, name, draw(st.floats(0, 1, exclude_max=True))
    if kind == "flip":
        return kind, name, (draw(st.floats(0, 1, exclude_max=True)), draw(st.integers(0, 7)))
    if kind == "meta_type":
        return kind, "meta.json", (draw(st.sampled_from(["files", "stats", "parts", "key", "checksum", "held_stats"])),
                                   draw(JSON_VALUES))  # fmt: skip
    if kind == "symlink":
        return kind, name, draw(st.sampled_from(["outside", "sibling", "dangling", "entry"]))
    if kind == "extra":
        return kind, draw(st.sampled_from(["extra.bin", "rows.arrow.bak", ".hidden"])), draw(st.binary(max_size=64))
    return kind, name, None


def apply(h: Harness, how: tuple) -> None:
    kind, name, arg = how
    path = h.entry / name
    if kind == "truncate":
        raw = path.read_bytes()
        path.write_bytes(raw[: int(arg * len(raw))])
    elif kind == "flip":
        raw = bytearray(path.read_bytes())
        raw[int(arg[0] * len(raw))] ^= 1 << arg[1]
        path.write_bytes(bytes(raw))
    elif kind == "meta_type":
        meta = json.loads(path.read_text())
        meta[arg[0]] = arg[1]
        path.write_text(json.dumps(meta))
    elif kind == "symlink":
        _symlink(h, path, arg)
    elif kind == "missing":
        path.unlink()
    elif kind == "extra":
        path.write_bytes(arg)
    elif kind == "folder":
        path.unlink()
        path.mkdir()
        (path / "x").write_text("x")
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)


def _symlink(h: Harness, path: Path, to: str) -> None:
    if to == "entry":  # the whole entry a link to a copy outside the cache
        copy = h.outside / "entry-copy"
        if not copy.exists():
            shutil.copytree(h.pristine, copy)
            h.untouched["outside"] = _snapshot(h.outside)
        shutil.rmtree(h.entry)
        h.entry.symlink_to(copy)
        return
    path.unlink()
    target = {"outside": h.outside / "file", "dangling": h.root / "nowhere"}.get(to)
    path.symlink_to(
        target if target is not None else h.entry / ("rows.arrow" if path.name != "rows.arrow" else "held.arrow")
    )


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return Harness(tmp_path_factory.mktemp("fuzz"))


def _run(h: Harness, how: tuple) -> None:
    h.reset()
    apply(h, how)
    h.check()


_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=FAST_EXAMPLES, derandomize=True, database=None, **_COMMON)
@given(how=damage())
def test_a_damaged_entry_is_rebuilt_or_named_never_trained_on(harness, how):
    _run(harness, how)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, database=None, **_COMMON)
@given(how=damage())
def test_a_damaged_entry_is_rebuilt_or_named_never_trained_on_many(harness, how):
    _run(harness, how)


def test_every_kind_of_damage_on_every_file(harness):
    """Each kind once on each file, deterministically, beside the sampled examples."""
    for kind in ["truncate", "flip", "symlink", "missing", "folder", "fifo"]:
        for name in FILES:
            arg = {"truncate": 0.5, "flip": (0.5, 3), "symlink": "outside"}.get(kind)
            _run(harness, (kind, name, arg))
    _run(harness, ("symlink", "rows.arrow", "entry"))
    _run(harness, ("extra", "extra.bin", b"\0"))
    _run(harness, ("meta_type", "meta.json", ("stats", "a string")))

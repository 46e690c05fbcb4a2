"""Property-based fuzzing of recipes and overrides through the real command line, in process.

Each example writes a recipe (the tiny one, sometimes with a line added or bytes that are not
UTF-8 spliced in) and runs ``llmft compile`` or the load/validate phase of ``llmft train``
(everything it does before the process group and the model: stopped at ``init_distributed``)
with random overrides: schema keys and their misspellings, values of every type, out of range,
NaN/inf, huge ints, YAML syntax fragments and tags, interpolations, unicode, non-UTF-8 bytes.

Properties, for every example:
- the command returns 0, or exits 2 with one message: ``llmft CMD: error: ...``, one paragraph,
  no traceback (any other exception fails the example);
- it ends within the deadline (hypothesis) and the test within pytest-timeout's limit;
- nothing is executed: no process is started (an audit hook sees every ``subprocess``,
  ``os.system``, ``exec`` and ``fork``), a YAML tag never constructs an object;
- nothing is written outside the example's temporary directory (the audit hook sees every
  file opened for writing, every directory made, every rename and removal).

The default suite runs a fixed, derandomized set of examples (reproducible in CI); ``-m slow``
runs many more, freshly drawn.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
from helpers import TINY_RECIPE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmft.cli import main
from llmft.recipe.schema import default_of, iter_fields

FIELDS = list(iter_fields())
KEYS = [key for key, _, _ in FIELDS]
CHOICES = [c for _, f, _ in FIELDS for c in f.metadata.get("choices", ())]


# ---------------------------------------------------------------- the audit: run, write, remove
class _Audit:
    """Every event of the ``sys.audit`` kinds below while ``root`` is set: a started process, or a
    path written, made, renamed or removed outside ``root``. A hook cannot be removed, so one is
    installed for the session and records only while an example runs."""

    RUN = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty")
    WRITE = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree", "os.symlink")

    def __init__(self) -> None:
        self.root: str | None = None
        self.bad: list[str] = []
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple) -> None:
        if self.root is None:
            return
        if event == "subprocess.Popen" and list(args[1])[1:] == ["--version"]:
            return  # model.compile=true: llmft.kernels asks torch for a C++ compiler, a fixed probe
        if event in self.RUN:
            self.bad.append(f"{event} {args!r:.200}")
        elif event == "open":
            path, mode, flags = args
            writes = (mode and any(c in mode for c in "wax+")) or (
                mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writes and not isinstance(path, int):
                self._check(event, path)
        elif event in self.WRITE:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)):
                    self._check(event, path)

    def _check(self, event: str, path) -> None:
        full = os.path.realpath(os.fsdecode(path))
        if not (full == self.root or full.startswith(self.root + os.sep)):
            self.bad.append(f"{event} {full}")


AUDIT = _Audit()


# ---------------------------------------------------------------- strategies
def _misspell(key: str, at: int, how: str) -> str:
    i = at % len(key)
    return {
        "drop": key[:i] + key[i + 1 :],
        "double": key[:i] + key[i] + key[i:],
        "swap": key[:i] + key[i + 1 : i + 2] + key[i : i + 1] + key[i + 2 :],
        "upper": key.upper(),
        "dots": key.replace(".", ".."),
        "section": key.split(".")[-1],
    }[how]


keys = st.one_of(
    st.sampled_from(KEYS),
    st.builds(
        _misspell,
        st.sampled_from(KEYS),
        st.integers(0, 40),
        st.sampled_from(["drop", "double", "swap", "upper", "dots", "section"]),
    ),
    st.sampled_from(KEYS).map(lambda k: k + ".x"),  # a dotted key into a value
    st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz_."), min_size=1, max_size=16),
    st.text(max_size=8).map(lambda t: f"model.config.{t}"),
    st.text(max_size=10),  # spaces, unicode, nothing
)

YAML_FRAGMENTS = [
    "[", "]", "{", "}", "[1, 2]", "{a: 1}", "{bits: 4}", "[q_proj, v_proj]", "'unclosed", '"', "|", ">",
    "- 1", ": x", "#", "&a 1", "*a", "%YAML 1.2", "---", "...", "\t", "\x00", "~", "null", "auto", "",
    "yes", "off", "0x10", "0o17", "1_000", "1e-4", "1e400", "-1e400", ".inf", "-.inf", ".nan", "inf", "nan",
    "2001-12-14", "!!binary aGVsbG8=", "!!set {a}", "!!float 1", "!!str 3", "!!int x", "!!timestamp 2001-12-14",
    "!!python/object/apply:os.system ['touch {root}/../pwned']",
    "!!python/object/new:os.system [echo]",
    "!!python/name:os.system",
    "${oc.env:HOME}", "${oc.env:LLMFT_FUZZ_UNSET}", "${oc.env:LLMFT_FUZZ_UNSET,3}", "${oc.decode:'[1]'}",
    "${oc.create:{a: 1}}", "${oc.select:run.seed}", "${oc.dict.keys:model}", "${run.seed}", "${nope.key}",
    "${run.name}", "${", "}", "$${x}", "\\${x}", "${oc.env:${oc.decode:1}}",
]  # fmt: skip

numbers = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.integers(-(2**64), 2**64).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from([str(2**31), str(2**32), str(2**63), str(2**63 - 1), str(2**64), "-0", "0", "1000000007"]),
    st.integers(4290, 4400).map(lambda n: "9" * n),  # around Python's int-to-string limit
)
values = st.one_of(
    numbers,
    st.sampled_from(YAML_FRAGMENTS),
    st.sampled_from(CHOICES).map(lambda c: "null" if c is None else str(c).lower() if isinstance(c, bool) else str(c)),
    st.booleans().map(str),
    st.text(max_size=20),  # unicode, control characters
    st.binary(max_size=8).map(os.fsdecode),  # bytes that are not UTF-8 reach argv as surrogates
    st.lists(numbers, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"),
)


def _plausible(f) -> st.SearchStrategy[str]:
    """A value of the key's own kind, often valid: so that examples also reach a written plan."""
    choices = f.metadata.get("choices")
    if choices:
        return st.sampled_from(choices).map(
            lambda c: "null" if c is None else str(c).lower() if c in (True, False) else str(c)
        )
    default = default_of(f)
    if isinstance(default, bool):
        return st.sampled_from(["true", "false"])
    if isinstance(default, int):
        return st.integers(0, 64).map(str)
    if isinstance(default, float):
        return st.floats(0, 1).map(repr)
    return st.sampled_from(["null", "x", "runs/fuzz", "[a, b]"])


plausible = st.sampled_from([(key, f) for key, f, sub in FIELDS if sub is None]).flatmap(
    lambda kf: _plausible(kf[1]).map(lambda v: f"{kf[0]}={v}")
)
overrides = st.one_of(
    st.lists(plausible, max_size=3),  # mostly valid: the plan is written
    st.lists(plausible, max_size=2),
    st.lists(
        st.one_of(
            plausible,
            st.builds(lambda k, v: f"{k}={v}", keys, values),
            st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), values),
            st.text(max_size=12),  # no '=', only '=', leading '-'
        ),
        max_size=4,
    ),
)


# compile's layout options: argparse reads an int, the recipe's ranges judge it
options = st.sampled_from([[], [], ["--nproc-per-node", "2"], ["--nnodes", "2", "--nproc-per-node", "4"]]) | st.lists(
    st.tuples(st.sampled_from(["--nproc-per-node", "--nnodes"]), st.one_of(numbers, st.sampled_from(["1", "2", "8"]))),
    max_size=2,
).map(lambda pairs: [x for pair in pairs for x in pair])


@st.composite
def recipe_bytes(draw) -> bytes:
    data = TINY_RECIPE.encode()
    kind = draw(st.sampled_from(["plain", "plain", "plain", "line", "bytes", "text"]))
    if kind == "line":  # a key of the file set to a fuzzed value
        line = f"{draw(keys)}: {draw(values)}\n".encode("utf-8", "surrogateescape")
        data += line
    elif kind == "bytes":  # bytes that are not UTF-8, or a BOM, at any position
        at = draw(st.integers(0, len(data)))
        junk = draw(st.one_of(st.binary(min_size=1, max_size=4), st.just(b"\xef\xbb\xbf"), st.just(b"\xff")))
        data = data[:at] + junk + data[at:]
    elif kind == "text":
        data = draw(st.text(max_size=60)).encode("utf-8", "surrogatepass")
    return data


# ---------------------------------------------------------------- the property
class _Validated(Exception):
    """Raised where `llmft train` would start the process group: the recipe passed every check."""


def _run(command: str, data: bytes, items: list[str], opts: list[str] = ()) -> int:
    with tempfile.TemporaryDirectory(prefix="llmft-fuzz-") as tmp:
        root = os.path.realpath(tmp)
        recipe = Path(root, "recipe.yaml")
        recipe.write_bytes(data)
        items = [i.replace("{root}", root) for i in items]
        argv = [command, str(recipe), *items]
        if command == "compile":
            argv += [*opts, "--out", str(Path(root, "out"))]
        err, cwd = io.StringIO(), os.getcwd()
        os.chdir(root)  # relative paths in the recipe land here
        AUDIT.root, AUDIT.bad = root, []
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                # train: everything before the process group is the load/validate phase; the
                # compiler probe of model.compile=true keeps torch's cache in the example's dir
                with (
                    mock.patch("llmft.training.train.init_distributed", side_effect=_Validated),
                    mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": str(Path(root, "inductor"))}),
                ):
                    try:
                        code = main(argv)
                    except _Validated:
                        code = 0
                    except SystemExit as e:  # argparse: an argument that looks like an option
                        code, command = e.code, ""
        finally:
            AUDIT.root = None
            os.chdir(cwd)
        assert not AUDIT.bad, f"{argv}: {AUDIT.bad}"
        message = err.getvalue()
        assert "Traceback" not in message, message
        assert code in (0, 2), (argv, code, message)
        if code == 2:  # argparse's own message is its usage line, then "llmft [COMMAND]: error: ..."
            head = re.search(f"^llmft {command}: error: " if command else r"^llmft( \w+)?: error: ", message, re.M)
            assert head, message
            body = message[head.end() :]
            assert body.strip() and "\n\n" not in body.strip(), message  # one paragraph
        assert not Path(root).parent.joinpath("pwned").exists()
        return code


COMMON = dict(
    deadline=timedelta(seconds=10),  # a hang, not a slow machine: pytest-timeout bounds the whole test
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
DEFAULT = settings(max_examples=80, derandomize=True, **COMMON)  # reproducible: the same cases every run
SLOW = settings(max_examples=500, derandomize=False, print_blob=True, **COMMON)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """Import what the commands import before auditing (a first import may write __pycache__)."""
    import llmft.training.train  # noqa: F401

    sys.dont_write_bytecode, old = True, sys.dont_write_bytecode
    os.environ.pop("LLMFT_FUZZ_UNSET", None)
    _run("compile", TINY_RECIPE.encode(), [])
    _run("train", TINY_RECIPE.encode(), [])
    yield
    sys.dont_write_bytecode = old


@pytest.mark.timeout(120)
@DEFAULT
@given(data=recipe_bytes(), items=overrides, opts=options)
def test_compile_fuzzed_recipes(data, items, opts):
    _run("compile", data, items, opts)


@pytest.mark.timeout(120)
@settings(DEFAULT, max_examples=40)
@given(data=recipe_bytes(), items=overrides)
def test_train_validation_fuzzed_recipes(data, items):
    _run("train", data, items)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@SLOW
@given(command=st.sampled_from(["compile", "train"]), data=recipe_bytes(), items=overrides, opts=options)
def test_fuzzed_recipes_many(command, data, items, opts):
    _run(command, data, items, opts if command == "compile" else [])

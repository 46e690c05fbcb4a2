"""A fuzzing harness over a checkpoint's ``objective/`` state files (hypothesis): GRPO's kept
generation batch, as ``llmft train`` reads it back to resume inside a generation batch.

A hand-made step dir (step 3 of a run with ``rl.iterations: 2``, a global batch of 8: inside
generation batch 1, positions 8..15) holds a valid ``objective/rank-0.pt``. Each example damages
the objective folder: random bytes (some with a zip's first bytes), truncations, bit flips, valid
torch files of random nested dict / list / tensor contents, the valid state with a field replaced,
dropped or added, a tensor of another dtype, shape or values (negative, NaN, huge), missing files,
extra files and wrong names (``rank-0.bak.pt``, ``rank-00.pt``, ``rank-1.pt``, a folder named
``rank-0.pt``), and what only a manifest can tell: the state saved again, another finite advantage. Then it is read as a resume reads it: ``check_checkpoint(resume=True)``, then
``CheckpointManager.load_objective_states`` and ``GRPOObjective.load_state_dict`` and the restored
rollout of the step's positions. The property:

- with the checkpoint's manifest (what ``llmft train`` writes): either a ``UserError`` naming a
  path in the step dir, or an exact resume: the restored completions, advantages and old log-probs
  are the saved ones (any changed byte is a refusal);
- without it (a checkpoint saved before the manifest): a ``UserError`` naming a path in the step
  dir, or a restore of the step's 8 completions that is well formed (the same as the saved one when
  the files are);
- never another exception.

The default suite runs ``FAST_EXAMPLES`` derandomized examples; ``-m slow`` runs ``SLOW_EXAMPLES``
random ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import TINY_LLAMA
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from llmft.checkpoint.layout import manifest
from llmft.checkpoint.manager import CheckpointManager
from llmft.checkpoint.verify import check_checkpoint
from llmft.errors import UserError
from llmft.job.dist import read_env
from llmft.objectives.grpo import STATE_HEADER, GRPOObjective

FAST_EXAMPLES = 100
SLOW_EXAMPLES = 1000
POSITIONS = tuple(range(8, 16))  # generation batch 1 of a global batch of 8
VOCAB = TINY_LLAMA["vocab_size"]


def valid_state() -> dict:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5, 2, 4, 6, 2, 3]
    return {
        **STATE_HEADER,
        "positions": torch.tensor(POSITIONS, dtype=torch.long),
        "completions": [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths],
        "old_logps": [-torch.rand(n, generator=gen) for n in lengths],
        "advantages": torch.randn(len(lengths), generator=gen),
        "stats": {"reward": 0.5, "completion_length": 3.25, "rewards/per_char": float("nan")},
    }


def make_step(root: Path, legacy: bool) -> Path:
    """A complete step-3 of a single-process GRPO run (model files tiny but whole)."""
    step = root / "run/checkpoints/step-3"
    (step / "model").mkdir(parents=True)
    (step / "objective").mkdir()
    recipe = {"model": {"config": TINY_LLAMA}, "train": {"objective": "grpo"}, "rl": {"iterations": 2}}
    (step / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    batch = {"global_batch_size": 8, "micro_batch_size": 8, "gradient_accumulation_steps": 1, "dp_size": 1}
    state = {"step": 3, "samples": 24, "tokens": 1, "epoch": 0.5, "world_size": 1, "engine": "single"}
    (step / "trainer_state.json").write_text(json.dumps({**state, "batch": batch, "scheduler": {}}))
    (step / "model/config.json").write_text(json.dumps(TINY_LLAMA))
    save_file({"w": torch.zeros(2)}, step / "model/model.safetensors")
    torch.save(valid_state(), step / "objective/rank-0.pt")
    marker = {"step": 3} if legacy else {"step": 3, "files": manifest(step)}
    (step / "COMPLETE").write_text(json.dumps(marker))
    return step


# --- what a damaged objective folder holds ------------------------------------------------------------

SCALARS = st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats() | st.text(max_size=6)
DTYPES = st.sampled_from([torch.int64, torch.int32, torch.float32, torch.float64, torch.bool, torch.uint8])


@st.composite
def tensors(draw) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 9), max_size=2))
    values = draw(st.sampled_from(["small", "negative", "nan", "huge"]))
    t = torch.rand(shape) * 20
    t = {"small": t, "negative": -t, "nan": t.masked_fill(t > 10, float("nan")), "huge": t * 1e12}[values]
    dtype = draw(DTYPES)
    return t.nan_to_num(0.0).to(dtype) if not dtype.is_floating_point else t.to(dtype)


NESTED = st.recursive(
    SCALARS | tensors(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
FIELDS = (*STATE_HEADER, "positions", "completions", "old_logps", "advantages", "stats")
NAMES = ["rank-0.bak.pt", "rank-00.pt", "rank-1.pt", "rank--1.pt", "rank-x.pt", "Rank-0.pt", "rank-0.pt.tmp"]


@st.composite
def damage(draw) -> tuple:
    kind = draw(
        st.sampled_from(
            ["bytes", "truncate", "flip", "nested", "field", "drop", "add", "tensor", "missing", "name", "folder"]
            + ["resave", "value", "stray"] * 2  # what a check cannot refuse without a manifest: the same state
        )
    )  # saved again, another finite advantage, a copy under a name that is never read
    if kind == "bytes":
        return (kind, draw(st.booleans()), draw(st.binary(max_size=256)))
    if kind in ("truncate", "flip"):
        return (kind, draw(st.floats(0, 1, exclude_max=True)), draw(st.integers(0, 7)))
    if kind == "nested":
        return (kind, draw(NESTED))
    if kind in ("field", "drop"):
        return (kind, draw(st.sampled_from(FIELDS)), draw(NESTED))
    if kind == "add":
        return (kind, draw(st.text(max_size=6)), draw(NESTED))
    if kind == "tensor":
        field = draw(st.sampled_from(["positions", "advantages", "completions", "old_logps"]))
        return (kind, field, draw(st.integers(0, 7)), draw(tensors()))
    if kind in ("name", "folder"):
        return (kind, draw(st.sampled_from(NAMES)), draw(st.booleans()))
    if kind == "value":
        return (kind, draw(st.integers(0, 7)), draw(st.floats(-5, 5)))
    if kind == "stray":
        return ("name", draw(st.sampled_from([n for n in NAMES if n != "rank-1.pt"])), False)
    return (kind,)


def apply(d: tuple, folder: Path) -> None:
    path = folder / "rank-0.pt"
    kind, args = d[0], d[1:]
    if kind == "name":  # a copy (or the file itself moved) under a wrong name
        if path.is_file() and not (folder / args[0]).is_dir():
            (shutil.move if args[1] else shutil.copyfile)(path, folder / args[0])
        return
    if kind == "folder":
        target = path if args[1] else folder / args[0]
        if target.is_file():
            target.unlink()
        target.mkdir(exist_ok=True)
        return
    if not path.is_file():
        return  # removed by an earlier damage of this example
    if kind == "bytes":
        path.write_bytes((b"PK\x03\x04" if args[0] else b"") + args[1])
    elif kind == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * args[0])])
    elif kind == "flip":
        data = bytearray(path.read_bytes())
        if data:
            data[int(len(data) * args[0])] ^= 1 << args[1]
            path.write_bytes(bytes(data))
    elif kind == "nested":
        torch.save(args[0], path)
    elif kind == "missing":
        path.unlink()
    else:
        try:
            state = torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 - an earlier damage made it unreadable: leave it so
            return
        if not isinstance(state, dict):
            return
        if kind == "value":
            adv = state.get("advantages")
            if isinstance(adv, torch.Tensor) and adv.dim() == 1 and adv.numel() > args[0]:
                adv[args[0]] = args[1]
        elif kind == "field":
            state[args[0]] = args[1]
        elif kind == "drop":
            state.pop(args[0], None)
        elif kind == "add":
            state[args[0]] = args[1]
        elif kind == "tensor":
            field, j, value = args
            if isinstance(state.get(field), list) and state[field]:
                state[field][j % len(state[field])] = value
            else:
                state[field] = value
        torch.save(state, path)


# --- reading it as a resume does -------------------------------------------------------------------


def _objective() -> GRPOObjective:
    """The part of a GRPO objective that restores a kept batch (no model, no rollout)."""
    objective = GRPOObjective.__new__(GRPOObjective)
    objective.rl = SimpleNamespace(iterations=2)
    objective.correction = False  # rl.importance_correction none: the kept batch holds no weights
    objective.policy = SimpleNamespace(get_input_embeddings=lambda: SimpleNamespace(num_embeddings=VOCAB))
    objective._restored, objective._restored_stats, objective._stats = {}, {}, {}
    objective.async_rollout = False  # rollout.async 0: the kept batch of rl.iterations
    return objective


def resume(step: Path):
    """(completions, advantages, old log-probs, importance weights) of the step's positions as a resume
    restores them."""
    check_checkpoint(step, resume=True)
    states = CheckpointManager(step.parents[1].parent, read_env(), None).load_objective_states(step)
    objective = _objective()
    objective.load_state_dict(states)
    return objective._restored_rollout(POSITIONS)


def _same(restored, state: dict) -> bool:
    return (
        all(k.is_weights is None for k in restored)
        and [k.ids for k in restored] == [c.tolist() for c in state["completions"]]
        and torch.equal(torch.tensor([k.advantage for k in restored]), state["advantages"])
        and all(torch.equal(k.old_logps, b) for k, b in zip(restored, state["old_logps"], strict=True))
    )


def check(tmp: Path, legacy: bool, damages: list[tuple]) -> str:
    shutil.rmtree(tmp, ignore_errors=True)
    step = make_step(tmp, legacy)
    pristine = (step / "objective/rank-0.pt").read_bytes()
    for d in damages:
        apply(d, step / "objective")
    kept = step / "objective/rank-0.pt"
    names = sorted(p.name for p in (step / "objective").iterdir())
    untouched = names == ["rank-0.pt"] and kept.is_file() and kept.read_bytes() == pristine
    try:
        restored = resume(step)
    except UserError as e:
        assert e.problems and e.problems[0].where.startswith(str(step)), str(e)
        assert not untouched, f"a whole objective state was refused: {e}"
        return "refused"
    assert restored is not None, "a checkpoint inside a generation batch was accepted without its kept batch"
    assert len(restored) == len(POSITIONS)
    assert all(len(k.old_logps) == len(k.ids) for k in restored)
    if untouched or not legacy:  # with the manifest, accepted means exact
        assert _same(restored, valid_state())
    return "exact" if _same(restored, valid_state()) else "accepted"


_COMMON = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
DAMAGES = st.lists(damage(), min_size=1, max_size=3)


def test_a_whole_objective_state_resumes_exactly(tmp_path):
    assert check(tmp_path / "manifest", False, []) == "exact"
    assert check(tmp_path / "legacy", True, []) == "exact"


@given(damages=DAMAGES, legacy=st.booleans())
@example(damages=[("flip", 0.765625, 7)], legacy=False)  # an entry name in the zip index no longer UTF-8
@example(damages=[("flip", 0.13643216591821616, 0)], legacy=True)  # a persistent id torch.load asserts on
@example(damages=[("field", "format", torch.tensor([], dtype=torch.int64))], legacy=True)  # no truth value
@settings(max_examples=FAST_EXAMPLES, derandomize=True, **_COMMON)
def test_damaged_objective_states_are_refused_by_name_or_resume_exactly(tmp_path, damages, legacy):
    check(tmp_path / "example", legacy, damages)


@pytest.mark.slow
@given(damages=DAMAGES, legacy=st.booleans())
@settings(max_examples=SLOW_EXAMPLES, **_COMMON)
def test_damaged_objective_states_many(tmp_path, damages, legacy):
    check(tmp_path / "example", legacy, damages)

"""The GRPO resume matrix (docs/reliability.md): every file of a checkpoint step dir missing,
truncated, foreign (a valid file of another kind or run), duplicated or stale (the same file of an
earlier step), and what the user sees: the exit code, the message naming the file, and, wherever
the run goes on (a fallback to the previous checkpoint, or a stale file identical to the right
one), final weights equal to the run that was never stopped.

One uninterrupted reference run per module: ``rl.iterations: 2`` (so step-1 and step-3 sit inside a
generation batch, whose kept completions and old log-probs are the ``objective/`` state), file
rollouts, SGD in fp32, a checkpoint every step. Each case copies it, drops step-4 (step-3, inside
generation batch 1, is the newest), damages one file of step-3 and resumes to step 4:

- ``checkpoint.resume=auto``: a damaged step-3 is skipped with a warning naming the file, step-2 (a
  generation boundary) is used, and the final weights are the reference's;
- ``checkpoint.resume=<step-3>``: exit 2 and the message names the file; nothing is trained.

The ``objective/`` cases run in the default tier; every other file of the step dir under ``-m slow``.
A checkpoint written before the checkpoint manifest (``COMPLETE`` holding only the step, objective
states without their header) is emulated by rewriting those two files (``_legacy``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from grpo_runs import grpo_recipe
from helpers import checkpoint_weights, max_rel_diff, metrics

from llmft.cli import main

TOLERANCE = 1e-6  # fp32 in one process: resumes are bit-exact here, the bound is the contract's


@dataclass
class Source:
    recipe: Path
    run: Path
    reference: dict[str, torch.Tensor]  # the final weights of the run that was never stopped


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Source:
    work = tmp_path_factory.mktemp("grpo-matrix") / "source"
    recipe = grpo_recipe(
        work, rl__iterations=2, train__max_steps=4, checkpoint__every_steps=1, checkpoint__keep_last=None
    )
    assert main(["train", str(recipe)]) == 0
    run = work / "run"
    return Source(recipe, run, checkpoint_weights(run / "checkpoints/step-4"))


def _copy(source: Source, tmp_path: Path) -> Path:
    """The reference run as it was after step 3: step-3 (inside generation batch 1) the newest."""
    run = tmp_path / "run"
    shutil.copytree(source.run, run, symlinks=True)
    shutil.rmtree(run / "checkpoints/step-4")
    (run / "checkpoints/latest").write_text("step-3")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if '"step": 4' not in line))
    return run


def _train(source: Source, run: Path, capsys, *overrides: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["train", str(source.recipe), f"run.output_dir={run}", "train.max_steps=4", *overrides])
    return rc, capsys.readouterr().err


def _legacy(step: Path) -> None:
    """``step`` as an llmft without the manifest wrote it: COMPLETE holds only the step, objective
    states have no ``objective``/``format`` header."""
    (step / "COMPLETE").write_text(json.dumps({"step": int(step.name.split("-")[1])}))
    for path in sorted((step / "objective").glob("rank-*.pt")):
        state = torch.load(path, weights_only=True)
        torch.save({k: v for k, v in state.items() if k not in ("objective", "format")}, path)


# --- faults: each changes step-3 and returns the file a message must name --------------------------


def _missing(step: Path, name: str) -> Path:
    path = step / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    return path


def _truncated(step: Path, name: str) -> Path:
    path = step / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    return path


# A valid file of another kind (or of another run: the initial weights) for each kind of file.
FOREIGN = {
    ".pt": lambda step, name: (step / "rng/rank-0.pt") if name != "rng/rank-0.pt" else (step / "optimizer.pt"),
    ".json": lambda step, name: step / ("COMPLETE" if name != "COMPLETE" else "trainer_state.json"),
    ".yaml": lambda step, name: step / ("plan.yaml" if name != "plan.yaml" else "recipe.yaml"),
    ".safetensors": lambda step, name: _base_model(step) / "model.safetensors",
    ".jinja": lambda step, name: step / "recipe.yaml",
}


def _base_model(step: Path) -> Path:
    """The model dir the run started from (its initial weights: a valid file of the same shapes)."""
    import yaml

    return Path(yaml.safe_load((step / "recipe.yaml").read_text())["model"]["name_or_path"])


def _foreign(step: Path, name: str) -> Path:
    path = step / name
    suffix = path.suffix if path.suffix in FOREIGN else ".json"
    shutil.copyfile(FOREIGN[suffix](step, name), path)
    return path


def _stale(step: Path, name: str) -> Path:
    path = step / name
    shutil.copyfile(step.parent / "step-2" / name, path)
    return path


def _duplicated(step: Path, name: str) -> Path:
    """A copy beside it: the next rank's name for a rank file, ``<name>.bak`` otherwise."""
    path = step / name
    twin = path.with_name("rank-1.pt") if path.name == "rank-0.pt" else path.with_name(path.name + ".bak")
    shutil.copyfile(path, twin)
    return twin


FAULTS = {"missing": _missing, "truncated": _truncated, "foreign": _foreign, "stale": _stale, "duplicated": _duplicated}


def _assert_fell_back(err: str, step3: Path, named: Path, source: Source, run: Path) -> None:
    assert f"not resuming from step-3: {named}: " in err, err[-3000:]
    assert f"resuming from {step3.parent / 'step-2'} (step 2," in err, err[-3000:]
    assert "Traceback" not in err
    assert max_rel_diff(checkpoint_weights(run / "checkpoints/step-4"), source.reference) <= TOLERANCE
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def _assert_refused_by_name(source: Source, run: Path, capsys, named: Path, what: str) -> None:
    step3 = run / "checkpoints/step-3"
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    rc, err = _train(source, run, capsys, f"checkpoint.resume={step3}")
    assert rc == 2, err[-3000:]
    assert f"llmft train: error: {named}: {what}" in err, err[-3000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing trained or saved


# --- the objective/ state: default tier ------------------------------------------------------------

OBJECTIVE = "objective/rank-0.pt"
# What the message says of each fault of step-3's objective state (the file named before it).
OBJECTIVE_CASES = {
    "missing": "is damaged: missing (the checkpoint was saved with it)",
    "truncated": "is damaged: not a whole torch.save file",
    "foreign": "is damaged: not the file the checkpoint was saved with",
    "stale": "is damaged: not the file the checkpoint was saved with",
    "duplicated": "is damaged: not part of the checkpoint as it was saved",
}


@pytest.mark.parametrize("fault", sorted(OBJECTIVE_CASES))
def test_a_damaged_objective_state_falls_back_to_the_generation_boundary(source, tmp_path, capsys, fault):
    run = _copy(source, tmp_path)
    step3 = run / "checkpoints/step-3"
    named = FAULTS[fault](step3, OBJECTIVE)
    rc, err = _train(source, run, capsys)
    assert rc == 0, err[-3000:]
    assert f"{named}: {OBJECTIVE_CASES[fault]}" in err, err[-3000:]
    _assert_fell_back(err, step3, named, source, run)


@pytest.mark.parametrize("fault", sorted(OBJECTIVE_CASES))
def test_a_damaged_objective_state_named_explicitly_is_refused(source, tmp_path, capsys, fault):
    run = _copy(source, tmp_path)
    named = FAULTS[fault](run / "checkpoints/step-3", OBJECTIVE)
    _assert_refused_by_name(source, run, capsys, named, OBJECTIVE_CASES[fault])


def test_a_stray_file_beside_the_objective_state_is_refused_not_a_traceback(source, tmp_path, capsys):
    run = _copy(source, tmp_path)
    step3 = run / "checkpoints/step-3"
    stray = step3 / "objective/rank-0.bak.pt"
    shutil.copyfile(step3 / OBJECTIVE, stray)
    rc, err = _train(source, run, capsys)
    assert rc == 0, err[-3000:]
    assert f"{stray}: is damaged: not part of the checkpoint as it was saved" in err
    _assert_fell_back(err, step3, stray, source, run)


# --- checkpoints written before the manifest: the objective state's content is the check ----------


def _shrunk(state: dict) -> dict:
    """The kept batch of a run with half the global batch (4 completions, not 8)."""
    return {
        **state,
        "positions": state["positions"][:4],
        "completions": state["completions"][:4],
        "old_logps": state["old_logps"][:4],
        "advantages": state["advantages"][:4],
    }


LEGACY_CASES = {  # fault of a legacy step-3's objective state -> what the message says of it
    "missing": (
        lambda step: _missing(step, "objective") and step / "objective",
        "is damaged: holds no objective state, but step 3 sits inside a generation batch (rl.iterations 2)",
    ),
    "foreign": (
        lambda step: _foreign(step, OBJECTIVE),
        "is damaged: not a GRPO objective state (its keys are numpy, python, torch; a GRPO state has positions,",
    ),
    "stale": (
        lambda step: _stale(step, OBJECTIVE),
        "is damaged: holds the kept generation batch of positions 0..7, but step 3 trained on positions 8..15",
    ),
    "smaller batch": (
        lambda step: (
            torch.save(_shrunk(torch.load(step / OBJECTIVE, weights_only=True)), step / OBJECTIVE) or step / OBJECTIVE
        ),
        "is damaged: holds the kept generation batch of positions 8..11, but step 3 trained on positions 8..15",
    ),
    "duplicated": (
        lambda step: _duplicated(step, OBJECTIVE),
        "is damaged: holds the kept generation batch of positions 8..15, which objective/rank-0.pt holds too",
    ),
}


@pytest.mark.parametrize("fault", sorted(LEGACY_CASES))
def test_an_older_checkpoint_with_a_wrong_objective_state_falls_back(source, tmp_path, capsys, fault):
    run = _copy(source, tmp_path)
    step3 = run / "checkpoints/step-3"
    _legacy(step3)
    make, what = LEGACY_CASES[fault]
    named = make(step3)
    rc, err = _train(source, run, capsys)
    assert rc == 0, err[-3000:]
    assert f"{named}: {what}" in err, err[-3000:]
    _assert_fell_back(err, step3, named, source, run)


def test_an_older_checkpoint_whose_objective_state_is_whole_resumes_exactly(source, tmp_path, capsys):
    run = _copy(source, tmp_path)
    step3 = run / "checkpoints/step-3"
    _legacy(step3)
    shutil.copyfile(step3 / OBJECTIVE, step3 / "objective/rank-0.bak.pt")  # never read: ignored, said
    rc, err = _train(source, run, capsys)
    assert rc == 0, err[-3000:]
    assert f"{step3 / 'objective/rank-0.bak.pt'}: ignored: not a rank-<R>.pt name" in err
    assert f"resuming from {step3} (step 3," in err and "not resuming" not in err
    assert max_rel_diff(checkpoint_weights(run / "checkpoints/step-4"), source.reference) <= TOLERANCE


def test_an_older_checkpoint_on_a_generation_boundary_needs_no_objective_state(source, tmp_path, capsys):
    run = _copy(source, tmp_path)
    shutil.rmtree(run / "checkpoints/step-3")
    step2 = run / "checkpoints/step-2"
    (run / "checkpoints/latest").write_text("step-2")
    _legacy(step2)
    shutil.rmtree(step2 / "objective")
    rc, err = _train(source, run, capsys)
    assert rc == 0, err[-3000:]
    assert f"resuming from {step2} (step 2," in err and "not resuming" not in err
    assert max_rel_diff(checkpoint_weights(run / "checkpoints/step-4"), source.reference) <= TOLERANCE


def test_a_resume_inside_a_generation_batch_with_another_global_batch_is_refused(source, tmp_path, capsys):
    run = _copy(source, tmp_path)
    rc, err = _train(source, run, capsys, "batch.global_batch_size=16", "batch.micro_batch_size=16")
    assert rc == 2, err[-3000:]
    assert (
        f"llmft train: error: {run / 'checkpoints/step-3'}: sits inside a generation batch (step 3, rl.iterations 2): "
        "its kept completions are a global batch of 8 completions with rl.iterations 2 and G 4; this recipe has 16, 2 "
        "and 4"
    ) in err, err[-3000:]


# --- every other file of the step dir: -m slow ---------------------------------------------------

FILES = (
    "COMPLETE",
    "trainer_state.json",
    "recipe.yaml",
    "plan.yaml",
    "rng/rank-0.pt",
    "optimizer.pt",
    "model/model.safetensors",
    "model/config.json",
    "model/generation_config.json",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/chat_template.jinja",
)


def _outcome(step: Path, name: str, fault: str) -> str:
    """What a resume does with ``fault`` of step-3's ``name``: ``fallback`` to step-2 naming the file;
    ``continue`` from step-3 where nothing a resume reads differs (a stale copy byte for byte the
    same; a COMPLETE replaced by trainer_state.json, which says step 3 too and reads as a checkpoint
    saved before the manifest); ``incomplete`` without COMPLETE (an interrupted save, no checkpoint)."""
    if fault == "stale" and (step / name).read_bytes() == (step.parent / "step-2" / name).read_bytes():
        return "continue"
    if name == "COMPLETE" and fault in ("foreign", "missing"):
        return {"foreign": "continue", "missing": "incomplete"}[fault]
    return "fallback"


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("name", FILES)
def test_every_file_of_the_step_dir(source, tmp_path, capsys, name, fault):
    """Each fault of each file: the user sees what ``_outcome`` says, and the run ends on the
    reference's weights; named explicitly, a checkpoint it falls back from is exit 2 naming the file."""
    run = _copy(source, tmp_path)
    step3 = run / "checkpoints/step-3"
    outcome = _outcome(step3, name, fault)
    named = FAULTS[fault](step3, name)
    rc, err = _train(source, run, capsys)
    assert rc == 0, err[-3000:]
    if outcome == "fallback":
        _assert_fell_back(err, step3, named, source, run)
        refused = _copy(source, tmp_path / "named")
        named = FAULTS[fault](refused / "checkpoints/step-3", name)
        _assert_refused_by_name(source, refused, capsys, named, "")
        return
    if outcome == "continue":
        assert f"resuming from {step3} (step 3," in err and "not resuming" not in err, err[-3000:]
    else:
        assert "checkpoints/latest names step-3, but step-2 is the newest complete checkpoint" in err, err[-3000:]
        assert f"resuming from {step3.parent / 'step-2'} (step 2," in err
    assert max_rel_diff(checkpoint_weights(run / "checkpoints/step-4"), source.reference) <= TOLERANCE
    if outcome == "incomplete":
        refused = _copy(source, tmp_path / "named")
        step = refused / "checkpoints/step-3"
        FAULTS[fault](step, name)
        _assert_refused_by_name(source, refused, capsys, step, "is an incomplete checkpoint (no COMPLETE marker")

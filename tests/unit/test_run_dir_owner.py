"""A folder of the user's is never taken for a run (docs/checkpoints.md, "Own files only").

`run.output_dir` without llmft's run marker (`.llmft-run`) is an llmft run only on strong
evidence: a complete checkpoint of an older llmft (`checkpoints/step-N/` whose `COMPLETE` marker
holds `{"step": N}`), or the resolved `recipe.yaml` llmft writes beside a `metrics.jsonl` of
llmft's rows. A `recipe.yaml` and a `metrics.jsonl` of the user's own are refused (exit 2, every
byte of the folder kept) unless `run.overwrite=true` hands the folder over. The other commands that
write into a folder the user names (`llmft compile --out`, `llmft export --out`, `llmft plot --out`)
refuse to replace a file they did not write.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import train_inproc, write_recipe

from llmft.checkpoint.rundir import RUN_MARKER, check_ours, is_llmft_run
from llmft.cli import main
from llmft.errors import UserError

# A user's own experiment folder: a recipe and metrics of another tool, notes, data.
USER_RECIPE = "model: my-own-model\nlr: 3e-4\n# my notes on this experiment\n"
USER_METRICS = '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.1}\n'


def tree_hash(root: Path) -> str:
    """One hash of every path, file byte and link target under ``root``."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_symlink():
            h.update(b"link:" + str(p.readlink()).encode())
        elif p.is_file():
            h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def user_folder(path: Path, *, recipe: str = USER_RECIPE, metrics: str = USER_METRICS) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "recipe.yaml").write_text(recipe)
    (path / "metrics.jsonl").write_text(metrics)
    (path / "notes.txt").write_text("results of the baseline\n")
    (path / "data").mkdir()
    (path / "data" / "train.jsonl").write_text('{"text": "mine"}\n')
    return path


def _train_cli(recipe: Path, *overrides: str) -> int:
    return main(["train", str(recipe), *overrides])


# --- a folder of the user's own holding a recipe.yaml and a metrics.jsonl --------------------------


def test_a_users_recipe_and_metrics_are_not_taken_for_a_run(tmp_path, capsys):
    mine = user_folder(tmp_path / "mine")
    before = tree_hash(mine)
    recipe = write_recipe(tmp_path, run__output_dir=str(mine))
    assert _train_cli(recipe) == 2
    err = capsys.readouterr().err
    assert tree_hash(mine) == before
    assert (
        f"run.output_dir: {mine} is not empty (data, metrics.jsonl, notes.txt, recipe.yaml) and is not an "
        "llmft run directory (no .llmft-run marker, no complete checkpoint, no recipe.yaml and metrics.jsonl "
        "that llmft wrote); llmft would replace or add to recipe.yaml, metrics.jsonl there." in err
    )
    assert "set run.overwrite=true" in err and f"touch {mine / RUN_MARKER}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "case",
    ["llmft_metrics_user_recipe", "llmft_recipe_user_metrics", "user_checkpoints", "only_a_file", "torn_metrics"],
)
def test_marker_less_folders_without_strong_evidence_are_refused(tmp_path, case, resolved_recipe_text):
    llmft_rows = '{"step": 1, "loss": 2.5, "lr": 0.001, "split": "train"}\n'
    mine = tmp_path / "mine"
    if case == "llmft_metrics_user_recipe":
        user_folder(mine, metrics=llmft_rows)
    elif case == "llmft_recipe_user_metrics":
        user_folder(mine, recipe=resolved_recipe_text)
    elif case == "user_checkpoints":  # step folders without llmft's COMPLETE marker ({"step": N})
        user_folder(mine)
        for n, marker in ((1, "done"), (2, '{"step": 3}'), (4, '{"step": true}')):
            (mine / f"checkpoints/step-{n}").mkdir(parents=True)
            (mine / f"checkpoints/step-{n}/COMPLETE").write_text(marker)
        (mine / "checkpoints/step-5").mkdir()
        (mine / "checkpoints/step-5/trainer_state.json").write_text("{}")
    elif case == "only_a_file":
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
    else:  # a resolved recipe, but a metrics file whose first line is not a row of llmft's
        user_folder(mine, recipe=resolved_recipe_text, metrics="not json\n" + llmft_rows)
    before = tree_hash(mine)
    assert not is_llmft_run(mine)
    with pytest.raises(UserError, match=r"is not empty \(.*\) and is not an llmft run directory"):
        check_ours(mine)
    assert tree_hash(mine) == before


def test_overwrite_hands_a_users_folder_over_and_keeps_every_other_file(tmp_path, capsys):
    mine = user_folder(tmp_path / "mine")
    keep = {p: p.read_bytes() for p in (mine / "notes.txt", mine / "data" / "train.jsonl")}
    recipe = write_recipe(tmp_path, run__output_dir=str(mine), train__max_steps=1)
    assert _train_cli(recipe, "run.overwrite=true") == 0
    err = capsys.readouterr().err
    assert f"run.overwrite=true: taking over {mine}, which is not an llmft run" in err
    assert "replacing or adding to your recipe.yaml, metrics.jsonl and leaves every other file" in err
    assert all(p.read_bytes() == data for p, data in keep.items())
    rows = [json.loads(line) for line in (mine / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [1]  # the user's rows are not appended to
    assert (mine / RUN_MARKER).is_file() and "batch:" in (mine / "recipe.yaml").read_text()


# --- llmft's own run directories still resume --------------------------------------------------


@pytest.fixture(scope="module")
def llmft_run(tmp_path_factory) -> Path:
    """A run of today's llmft: 2 steps, a checkpoint at each."""
    tmp = tmp_path_factory.mktemp("owner")
    recipe = write_recipe(tmp, train__max_steps=2, checkpoint__every_steps=1, checkpoint__keep_last=None)
    assert train_inproc(recipe) == 0
    return tmp


@pytest.fixture(scope="module")
def resolved_recipe_text(llmft_run) -> str:
    return (llmft_run / "run" / "recipe.yaml").read_text()


def _copy(llmft_run: Path, tmp_path: Path, drop: tuple[str, ...] = ()) -> Path:
    """A copy of the run (less ``drop``) and a recipe that continues it there (same data file)."""
    run = tmp_path / "run"
    shutil.copytree(llmft_run / "run", run, symlinks=True)
    for name in drop:
        p = run / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return write_recipe(
        tmp_path,
        run__output_dir=str(run),
        data__train=str(llmft_run / "train.jsonl"),
        checkpoint__every_steps=1,
        checkpoint__keep_last=None,
    )


@pytest.mark.parametrize("kind", ["today", "older_with_checkpoints"])
def test_llmft_runs_with_and_without_the_marker_resume(llmft_run, tmp_path, kind, capsys):
    drop = () if kind == "today" else (RUN_MARKER,)
    recipe = _copy(llmft_run, tmp_path, drop)
    run = recipe.parent / "run"
    assert (run / RUN_MARKER).exists() == (kind == "today")
    capsys.readouterr()
    assert train_inproc(recipe, "train.max_steps=3") == 0
    assert f"resuming from {run / 'checkpoints' / 'step-2'} (step 2," in capsys.readouterr().err
    assert (run / RUN_MARKER).is_file()  # marked now: the next start needs no evidence
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_an_older_run_without_checkpoints_is_recognised_by_its_recipe_and_metrics(llmft_run, tmp_path):
    recipe = _copy(llmft_run, tmp_path, drop=(RUN_MARKER, "checkpoints"))
    run = recipe.parent / "run"
    assert is_llmft_run(run)
    assert check_ours(run) is False  # accepted, not taken over
    (run / "recipe.yaml").write_text(USER_RECIPE)  # the same folder with a recipe llmft did not write
    assert not is_llmft_run(run)
    with pytest.raises(UserError, match="llmft would replace or add to recipe.yaml, metrics.jsonl there"):
        check_ours(run)


# --- the other commands that write into a folder the user names ---------------------------------


def test_compile_out_refuses_a_users_file_and_rewrites_its_own(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "recipe.yaml").write_text(USER_RECIPE)
    (mine / "plan.yaml").write_text("my plan\n")
    before = tree_hash(mine)
    assert main(["compile", str(recipe), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert tree_hash(mine) == before
    assert f"{mine}: holds plan.yaml, recipe.yaml, which llmft compile did not write" in err
    assert "Choose another --out" in err

    out = tmp_path / "compiled"
    assert main(["compile", str(recipe), "--out", str(out)]) == 0
    assert main(["compile", str(recipe), "batch.micro_batch_size=2", "--out", str(out)]) == 0  # its own: rewritten
    assert "micro 2 x accumulation 4" in (out / "recipe.yaml").read_text()
    (out / "notes.txt").write_text("mine")  # a file of the user's beside compile's: kept, no refusal
    assert main(["compile", str(recipe), "--out", str(out)]) == 0
    assert (out / "notes.txt").read_text() == "mine"


def test_export_out_refuses_a_non_empty_folder(llmft_run, tmp_path, capsys):
    mine = user_folder(tmp_path / "mine")
    before = tree_hash(mine)
    step = llmft_run / "run" / "checkpoints" / "step-2"
    assert main(["export", str(step), "--out", str(mine)]) == 2
    assert tree_hash(mine) == before
    assert f"{mine}: already exists and is not empty. Choose another --out, or delete it." in capsys.readouterr().err


def test_plot_out_refuses_a_file_it_did_not_write(llmft_run, tmp_path, capsys):
    run = llmft_run / "run"
    mine = tmp_path / "figure.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n my own figure")
    assert main(["plot", str(run), "--out", str(mine)]) == 2
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n my own figure"
    assert f"{mine}: exists and was not written by llmft plot" in capsys.readouterr().err
    out = tmp_path / "plot.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert main(["plot", str(run), "--out", str(out)]) == 0  # its own: replaced
    assert main(["runs", str(run), "--out", str(mine)]) == 2  # llmft runs: the same rule
    assert mine.read_bytes() == b"\x89PNG\r\n\x1a\n my own figure"


def test_plot_replaces_an_older_llmft_plot_in_its_run_only(llmft_run, tmp_path, capsys):
    """llmft plot before it signed its PNGs wrote plain matplotlib ones into the run: those are
    replaced at the default path of an llmft run; at an --out, and in a folder of the user's, not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = tmp_path / "run"
    shutil.copytree(llmft_run / "run", run, symlinks=True)
    fig = plt.figure()
    fig.savefig(run / "metrics.png")  # matplotlib's own Software chunk, as an older llmft left it
    plt.close(fig)
    older = (run / "metrics.png").read_bytes()
    shutil.copy(run / "metrics.png", tmp_path / "elsewhere.png")
    assert main(["plot", str(run), "--out", str(tmp_path / "elsewhere.png")]) == 2
    assert main(["plot", str(run)]) == 0
    assert (run / "metrics.png").read_bytes() != older
    (run / ".llmft-run").unlink()
    shutil.rmtree(run / "checkpoints")
    (run / "recipe.yaml").write_text(USER_RECIPE)  # no longer an llmft run: its metrics.png is the user's
    (run / "metrics.png").write_bytes(older)
    assert main(["plot", str(run)]) == 2
    assert (run / "metrics.png").read_bytes() == older
    assert "exists and was not written by llmft plot" in capsys.readouterr().err

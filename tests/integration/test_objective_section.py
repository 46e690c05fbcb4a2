"""An objective from outside llmft with a recipe section of its own (tests/scaled_sft_objective.py:
``scaled.scale`` times SFT's loss) goes through every command like a built-in one: ``llmft compile``
prints its line and writes its section, ``llmft train`` runs the compiled dir (its banner line, its
section read by the runtime: scale 2 at lr 0.5 is SFT's update at lr 1 under SGD), resumes from the
run's recipe, ``llmft verify`` checks it and ``llmft export`` writes its card words. None of the
generic modules names it (docs/design.md, "Adding an objective"; tests/unit/test_recipe_sections.py
checks the section's loading)."""

from __future__ import annotations

from helpers import max_rel_diff, metrics, train_inproc, write_recipe

from llmft.cli import main
from llmft.export.consolidate import load_checkpoint_model, trainable_state

SGD = {"optim__name": "sgd", "optim__max_grad_norm": None, "checkpoint__every_steps": 1}
SCALED = {"train__objective": "scaled_sft", "train__objective_module": "scaled_sft_objective"}


def _weights(run_dir):
    return trainable_state(load_checkpoint_model(run_dir)[0])


def test_a_section_from_outside_compiles_trains_resumes_verifies_and_exports(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "scaled", **SGD, **SCALED, optim__lr=0.5, scaled={"scale": 2.0})
    out, run = tmp_path / "scaled" / "out", tmp_path / "scaled" / "run"
    assert main(["compile", str(recipe), "--out", str(out)]) == 0
    assert "global 8\nscaled SFT: loss x 2.0\n" in capsys.readouterr().out
    assert "\nscaled:\n  scale: 2.0\n" in (out / "recipe.yaml").read_text()

    assert main(["train", str(out)]) == 0
    assert "scaled SFT: loss x 2.0" in "".join(capsys.readouterr())  # the banner
    assert "\nscaled:\n  scale: 2.0\n" in (run / "recipe.yaml").read_text()
    assert "\nscaled:\n  scale: 2.0\n" in (run / "checkpoints" / "step-2" / "recipe.yaml").read_text()
    sft = write_recipe(tmp_path / "sft", **SGD, optim__lr=1.0)
    assert train_inproc(sft) == 0
    assert max_rel_diff(_weights(run), _weights(tmp_path / "sft" / "run")) <= 1e-6

    assert main(["train", str(out), "train.max_steps=3"]) == 0  # resumes step 2 under the run's recipe
    assert [row["step"] for row in metrics(run)] == [1, 2, 3]

    assert main(["verify", str(recipe)]) == 0
    assert "loss:    scaled_sft, big batch" in capsys.readouterr().out
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "| objective | scaled_sft (next-token loss times a constant); scale 2.0 |" in card

"""``preference.precompute_reference`` in whole ``llmft train`` runs, one process (docs/preference.md
"Precomputed reference"): the same losses, metrics and weights as the on-the-fly reference (fp32,
1e-6); the log-probs stored beside the pair cache entry, keyed by the reference weights, reused by
a second run and a resume (the pass does not run again), recomputed for another reference; no
reference forward during training; and exact resume of dpo with and without it (weights' bytes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import metrics, train_inproc
from preference_runs import assert_same_run, dpo_recipe, final_weights, reference_files

from llmft.objectives import preference

STEPS = 4


CASES = [
    ("sigmoid", "none", False),  # full fine-tune: the reference is the initial weights
    ("sigmoid", "lora", False),  # adapters disabled
    ("ipo", "lora", True),  # a mean per target token, padding-free pairs
    ("hinge", "none", True),
]


@pytest.mark.parametrize("loss_type,method,packing", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_precomputed_equals_on_the_fly(tmp_path, monkeypatch, loss_type, method, packing):
    over = dict(preference__loss_type=loss_type, peft__method=method, data__packing=packing)
    fly = dpo_recipe(tmp_path / "fly", **over)
    assert train_inproc(fly) == 0
    assert reference_files(tmp_path / "cache") == []

    def no_reference_forward(*args, **kwargs):
        raise AssertionError("a reference forward ran during training")

    built = []
    init = preference.PreferenceObjective.__init__

    def recording_init(self, plan, engine):
        init(self, plan, engine)
        built.append(self)

    pre = dpo_recipe(tmp_path / "pre", **over, preference__precompute_reference=True)
    with monkeypatch.context() as m:  # training (and eval) hold no reference model and run no reference forward
        m.setattr(preference.PreferenceObjective, "_adapters_disabled", no_reference_forward)
        m.setattr(preference.PreferenceObjective, "__init__", recording_init)
        assert train_inproc(pre) == 0
    assert len(built) == 1 and built[0].precomputed and built[0].reference is None
    files = reference_files(tmp_path / "cache")
    assert [f.name for f in files] == ["held.npy", "rows.npy"]  # the held-out pairs too
    values = np.load(files[1])
    assert values.shape == (36, 4) and (values[:, :2] < 0).all() and (values[:, 2:] >= 1).all()
    assert_same_run(tmp_path / "pre", tmp_path / "fly")


def test_a_second_run_reuses_and_another_reference_recomputes(tmp_path, capfd):
    first = dpo_recipe(tmp_path / "a", peft__method="lora", preference__precompute_reference=True)
    assert train_inproc(first) == 0
    assert "reference log-probs: computed 36 pairs" in capfd.readouterr().err
    (rows,) = [f for f in reference_files(tmp_path / "cache") if f.name == "rows.npy"]
    stamp = rows.stat().st_mtime_ns

    # another run on the same base (a full fine-tune: the same reference weights) reads them back
    second = dpo_recipe(tmp_path / "b", peft__method="none", preference__precompute_reference=True)
    assert train_inproc(second) == 0
    err = capfd.readouterr().err
    assert f"reference log-probs: reused {rows} (36 pairs)" in err and "computed" not in err
    assert rows.stat().st_mtime_ns == stamp

    # another reference (another seeded init) gets its own key; the first stays
    third = dpo_recipe(tmp_path / "c", peft__method="lora", preference__precompute_reference=True, run__seed=1)
    assert train_inproc(third) == 0
    assert "reference log-probs: computed 36 pairs" in capfd.readouterr().err
    assert len({f.parent for f in reference_files(tmp_path / "cache")}) == 2

    # a damaged file is not trusted: computed again, to the same values
    want = np.load(rows)
    rows.write_bytes(rows.read_bytes()[:-4] + b"\0\0\0\0")
    assert train_inproc(second, f"run.output_dir={tmp_path / 'd' / 'run'}") == 0
    assert "reference log-probs: computed 36 pairs" in capfd.readouterr().err
    assert np.array_equal(np.load(rows), want)


def test_a_named_reference_model_is_hashed_by_its_files(tmp_path, capfd):
    from helpers import save_tiny_pretrained

    model = save_tiny_pretrained(tmp_path / "ref-model", seed=3)
    named = dpo_recipe(tmp_path / "a", peft__method="lora", preference__reference=str(model))
    fly = dpo_recipe(tmp_path / "fly", peft__method="lora", preference__reference=str(model))
    assert train_inproc(fly) == 0
    assert train_inproc(named, "preference.precompute_reference=true") == 0
    assert "reference log-probs: computed 36 pairs" in capfd.readouterr().err
    assert_same_run(tmp_path / "a", tmp_path / "fly")
    assert train_inproc(named, "preference.precompute_reference=true", f"run.output_dir={tmp_path / 'b' / 'run'}") == 0
    assert "reference log-probs: reused" in capfd.readouterr().err
    weights = next(model.glob("*.safetensors"))
    weights.touch()  # rewritten (a newer mtime): the key changes
    assert train_inproc(named, "preference.precompute_reference=true", f"run.output_dir={tmp_path / 'c' / 'run'}") == 0
    assert "reference log-probs: computed 36 pairs" in capfd.readouterr().err


SLOW = pytest.mark.slow  # three whole runs each; the unit test in test_preference.py covers on-the-fly resume
RESUMES = [
    pytest.param("lora", True, id="lora-precomputed"),
    pytest.param("none", True, id="full-precomputed"),
    pytest.param("lora", False, id="lora-on-the-fly", marks=SLOW),
    pytest.param("none", False, id="full-on-the-fly", marks=SLOW),
]


@pytest.mark.parametrize("method,precompute", RESUMES)
def test_resume_is_bit_exact(tmp_path, capfd, method, precompute):
    """4 steps straight == 2 steps, stop, resume to 4: the same weight bytes; a precomputed
    reference is read back on resume (keyed by the weights), not computed again."""
    over = dict(peft__method=method, preference__precompute_reference=precompute, checkpoint__every_steps=2)
    straight = dpo_recipe(tmp_path / "straight", **over)
    assert train_inproc(straight) == 0
    halves = dpo_recipe(tmp_path / "halves", **over)
    assert train_inproc(halves, "train.max_steps=2") == 0
    capfd.readouterr()
    stamps = {f: f.stat().st_mtime_ns for f in reference_files(tmp_path / "cache")}
    assert train_inproc(halves) == 0
    err = capfd.readouterr().err
    assert "resuming from" in err and "step 2" in err
    assert "reference log-probs: computed" not in err
    assert ("reference log-probs: reused" in err) == precompute
    assert {f: f.stat().st_mtime_ns for f in reference_files(tmp_path / "cache")} == stamps
    a, b = final_weights(tmp_path / "straight"), final_weights(tmp_path / "halves")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = metrics(tmp_path / "straight" / "run"), metrics(tmp_path / "halves" / "run")
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]

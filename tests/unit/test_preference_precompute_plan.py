"""``preference.precompute_reference`` at resolve, and the reference key (docs/preference.md
"Precomputed reference"). Whole runs: tests/integration/test_preference_precompute.py, 2 ranks:
tests/distributed/test_preference_precompute_ranks.py."""

from __future__ import annotations

import pytest
from helpers import save_tiny_pretrained, write_recipe

from llmft.objectives.reference import fingerprint, fingerprint_parts
from llmft.plan.resolve import resolve
from llmft.recipe import load_recipe
from llmft.recipe.load import RecipeError

DPO = ["train.objective=dpo", "preference.precompute_reference=true"]


def _plan(tmp_path, *overrides: str):
    return resolve(load_recipe(write_recipe(tmp_path), list(overrides)))


def _problems(tmp_path, *overrides: str) -> list[str]:
    with pytest.raises(RecipeError) as e:
        _plan(tmp_path, *overrides)
    return [f"{p.where}: {p.what} | {p.fix}" for p in e.value.problems]


def test_a_stream_is_refused_with_the_keys_and_the_fix(tmp_path):
    assert _problems(tmp_path, *DPO, "data.streaming=true", "data.eval_fraction=0") == [
        "override 'preference.precompute_reference=true': preference.precompute_reference: is true, but "
        "data.streaming is true: the reference log-probs are stored with the token cache entry, and a stream has "
        "none (its pairs are tokenized as training reaches them) | Set data.streaming=false (the pairs go through "
        "the token cache; `llmft prepare` builds it ahead), or preference.precompute_reference=false (the "
        "reference runs on the fly)."
    ]


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_a_reference_free_loss_has_nothing_to_precompute(tmp_path, loss_type):
    assert _problems(tmp_path, *DPO, f"preference.loss_type={loss_type}") == [
        "override 'preference.precompute_reference=true': preference.precompute_reference: is true, but "
        f"loss_type={loss_type} is reference-free: there are no reference log-probs to precompute | "
        "Set preference.precompute_reference=false."
    ]


@pytest.mark.parametrize("method", ["lora", "none", "dora"])
def test_it_resolves_for_every_reference(tmp_path, method):
    plan = _plan(tmp_path, *DPO, f"peft.method={method}")
    assert plan.recipe.preference.precompute_reference
    assert plan.reference == ("frozen_copy" if method == "none" else "adapters_disabled")


def test_the_key_is_the_reference_weights(tmp_path):
    """LoRA (adapters disabled) and a full fine-tune (initial weights) of one base share a key; another
    base, dtype, quantization or named reference, or a weight file rewritten, does not."""
    model = save_tiny_pretrained(tmp_path / "base", seed=1)
    other = save_tiny_pretrained(tmp_path / "other", seed=2)
    on = ["model.config=null", f"model.name_or_path={model}", *DPO]

    def key(*extra: str) -> str:
        parts = fingerprint_parts(_plan(tmp_path, *on, *extra))
        assert parts is not None
        return fingerprint(parts)

    base = key("peft.method=lora")
    assert key("peft.method=none") == base == key("peft.method=dora", "optim.lr=0.5", "batch.micro_batch_size=2")
    assert key("model.dtype=bf16") != base
    assert key(f"preference.reference={other}") != base
    assert key(f"preference.reference={model}") == key(f"preference.reference={model}", "peft.method=none")
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # rewritten: same bytes, a new mtime
    assert key("peft.method=lora") != base
    fresh = fingerprint(fingerprint_parts(_plan(tmp_path, *DPO)))
    assert fresh != fingerprint(fingerprint_parts(_plan(tmp_path, *DPO, "run.seed=1")))

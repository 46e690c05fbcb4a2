"""No code from the Hub unless the recipe asks (docs/design.md G7, docs/offline.md): every way llmft builds a
model keeps transformers from kernelizing it, and ``model.hub_kernels: true`` is what turns it on.

transformers >= 5.2x treats ``from_pretrained(use_kernels=None)`` as True and, with the ``kernels``
package installed, replaces layers by kernels downloaded from the Hub (on CUDA; on the CPU the same
call is made and finds nothing to replace, which is why only a stub shows it here). The stub below
fails the test in ``PreTrainedModel.set_use_kernels(True)`` and in ``kernelize``, the two entries of
that path, and records every ``set_use_kernels`` call, so that each load path shows it reached
transformers' loading code and asked for no kernels."""

from __future__ import annotations

import pytest
import torch
from helpers import pretrained_model, save_tiny_pretrained, train_inproc, write_recipe
from preference_runs import write_pairs
from transformers import PreTrainedModel
from transformers import modeling_utils as hf_modeling
from transformers.integrations import hub_kernels

from llmft.data.tokenizer import byte_tokenizer
from llmft.export.consolidate import load_checkpoint_model
from llmft.export.export import export
from llmft.model.build import build_model
from llmft.plan.report import plan_command
from llmft.recipe import load_recipe
from llmft.training.verify import check_gradients, load_for_verify


class HubKernelsAsked(Exception):
    """Raised by the stub when the opt-in is on: the request reached transformers."""


class KernelCalls(list):
    opt_in = False  # the recipe asks for hub kernels: the stub raises HubKernelsAsked instead of failing


@pytest.fixture
def kernel_calls(monkeypatch):
    """The ``use_kernels`` of every ``set_use_kernels`` call; a call asking for kernels fails the test."""
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)  # transformers' default: enabled
    calls = KernelCalls()

    def set_use_kernels(self, use_kernels, *args, **kwargs):
        calls.append(bool(use_kernels))
        if use_kernels:
            if calls.opt_in:
                raise HubKernelsAsked
            pytest.fail(f"{type(self).__name__} was loaded with hub kernels on (use_kernels={use_kernels!r})")

    def kernelize(*args, **kwargs):
        pytest.fail("transformers' kernelize ran: layers would be replaced by Hub kernels")

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", set_use_kernels)
    monkeypatch.setattr(hf_modeling, "kernelize", kernelize)
    monkeypatch.setattr(hub_kernels, "kernelize", kernelize)
    return calls


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("hub-kernels") / "tiny", seed=0)


def _from_dir(pretrained, **keys) -> dict:
    model = pretrained_model(pretrained)
    return {**{f"model__{k}": v for k, v in model.items()}, "model__config": None, "train__max_steps": 1, **keys}


PATHS = {
    "full": {},
    "lora": {"peft__method": "lora", "peft__r": 4},
    "qlora": {"peft__method": "lora", "peft__r": 4, "model__quantization": {"bits": 4}},
    "dpo-named-reference": {"train__objective": "dpo", "batch__micro_batch_size": 2},
    "reward": {"train__objective": "reward", "peft__method": "lora", "peft__r": 4, "batch__micro_batch_size": 2},
}
PAIRS = {"dpo-named-reference", "reward"}


@pytest.mark.parametrize("path", list(PATHS))
def test_training_loads_no_hub_kernels(tmp_path, pretrained, kernel_calls, path):
    keys = _from_dir(pretrained, **PATHS[path])
    if path in PAIRS:
        keys["data__train"] = str(write_pairs(tmp_path / "pairs.jsonl", n=16))
    if path == "dpo-named-reference":
        keys["preference__reference"] = str(pretrained)  # the reference model, loaded like the policy
    assert train_inproc(write_recipe(tmp_path, **keys)) == 0
    # the policy (and the named reference): each loaded through from_pretrained
    assert kernel_calls == [False] * (2 if path == "dpo-named-reference" else 1)


def test_fresh_quantized_and_meta_builds_load_no_hub_kernels(tmp_path, pretrained, kernel_calls):
    """model.config + 4-bit (written to a temporary dir and loaded back) and the meta-device build of a
    pretrained model (FSDP2, export's streamed full model): from_config paths that never kernelize."""
    tok = byte_tokenizer()
    qlora = load_recipe(write_recipe(tmp_path, peft__method="lora", peft__r=4, model__quantization={"bits": 4}))
    build_model(qlora, tok)
    assert kernel_calls == [False]
    meta = load_recipe(write_recipe(tmp_path, **_from_dir(pretrained)))
    model = build_model(meta, tok, init_context=lambda: torch.device("meta"))
    assert next(model.parameters()).device.type == "meta"
    assert kernel_calls == [False]


@pytest.mark.parametrize("base", ["pretrained", "config"])
def test_export_consolidate_and_verify_load_no_hub_kernels(tmp_path, pretrained, kernel_calls, base):
    """A DoRA adapter is merged in memory, into a base loaded by from_pretrained: the named model, or
    the base a model.config run saved beside its checkpoint."""
    keys = {"peft__method": "dora", "peft__r": 4, "train__max_steps": 1}
    recipe = write_recipe(tmp_path, **(_from_dir(pretrained, **keys) if base == "pretrained" else keys))
    assert train_inproc(recipe) == 0
    before = len(kernel_calls)
    export(tmp_path / "run", tmp_path / "adapter")
    export(tmp_path / "run", tmp_path / "merged", merge_lora=True)
    load_checkpoint_model(tmp_path / "run")
    check_gradients(load_for_verify(str(recipe)))
    assert len(kernel_calls) > before
    assert not any(kernel_calls)


def test_opt_in_reaches_transformers(tmp_path, pretrained, kernel_calls):
    kernel_calls.opt_in = True
    recipe = write_recipe(tmp_path, **_from_dir(pretrained, model__hub_kernels=True))
    with pytest.raises(HubKernelsAsked):
        train_inproc(recipe)
    assert kernel_calls == [True]


def test_plan_says_which_attention_and_kernels(tmp_path):
    recipe = str(write_recipe(tmp_path))
    line = "attention eager; kernels: hub kernels off, liger off, compile off"
    assert f"\n{line}\n" in plan_command(recipe, [])
    on = plan_command(recipe, ["model.hub_kernels=true", "model.attn_implementation=sdpa"])
    assert "\nattention sdpa; kernels: hub kernels on (downloaded from the Hugging Face Hub at load), liger off" in on

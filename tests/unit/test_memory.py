import functools

import pytest
from helpers import LLAMA_8B_RECIPE, write_text_recipe
from hypothesis import given, settings
from hypothesis import strategies as st

from llmft.errors import UserError
from llmft.plan.batch import divisors
from llmft.plan.engines import choose_engine
from llmft.plan.memory import (
    DTYPE_BYTES,
    GIB,
    count_params,
    estimate,
    estimate_memory,
    pick_micro_batch,
    quantized_bytes_per_param,
)
from llmft.plan.report import plan_command
from llmft.plan.resolve import load_plan
from llmft.plan.shape import model_shape
from llmft.recipe import RecipeError


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(write_text_recipe(tmp_path_factory, "mem", LLAMA_8B_RECIPE))


def load(path, *overrides, nproc=1):
    return load_plan(path, list(overrides), nnodes=1, nproc_per_node=nproc)


def estimate_on(plan, dp_size=None, micro_batch_size=None):
    """The plan's estimate, optionally as if on ``dp_size`` ranks or with another micro-batch."""
    micro = micro_batch_size or plan.batch.micro_batch_size
    return estimate(plan.recipe, plan.engine, dp_size or plan.dp_size, micro, plan.batch.gradient_accumulation_steps)


QLORA = ("model.quantization={bits: 4}", "peft.method=lora", "model.gradient_checkpointing=true")


def gib(nbytes: int) -> float:
    return nbytes / GIB


def test_qlora_8b_fits_a_consumer_gpu(base):
    est = estimate_on(load(base, *QLORA), dp_size=1)
    assert 6 < gib(est.total) < 14, est.components()
    # The frozen 4-bit base dominates the weights; embedding and head stay unquantized and frozen in
    # the compute dtype (no fp32 copy): 1.05 B params x 2 B = 2.0 GiB.
    shape = model_shape(load(base).recipe.model)
    p = count_params(load(base, *QLORA).recipe, shape)
    assert p.linear == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert est.weights == pytest.approx(p.linear * quantized_bytes_per_param(4, True) + p.other * 2, abs=1)
    # LoRA r=16 on all 7 linears of 32 layers: 41.9 M fp32 params; grads 4 B, AdamW 8 B each.
    assert p.adapters == 32 * 16 * (2 * 8192 + 2 * 5120 + 2 * (4096 + 14336) + (14336 + 4096))
    assert est.adapters == p.adapters * 4 and est.gradients == p.adapters * 4 and est.optimizer == p.adapters * 8


def test_full_finetune_8b_does_not_fit_one_gpu(base):
    est = estimate_on(load(base), dp_size=1)
    assert gib(est.total) > 100
    assert not est.fits(80)


def test_zero3_divides_states_by_dp(base):
    r = load(base, "distributed.engine=deepspeed", "distributed.zero_stage=3", nproc=8)
    one, eight = estimate_on(r, dp_size=1), estimate_on(r, dp_size=8)
    # ZeRO-3's reduce bucket (reduce_bucket_size = hidden^2 gradients, bf16) is whole on every rank
    h = model_shape(r.recipe.model).hidden_size
    bucket = h * h * 2
    for name in ("weights", "gradients", "optimizer", "master_weights"):
        extra = bucket if name == "gradients" else 0
        assert getattr(eight, name) - extra == pytest.approx((getattr(one, name) - extra) / 8, abs=1), name
    # bf16 under DeepSpeed: 2 (weights) + 2 (grads) + 4 (master) + 8 (Adam) bytes per parameter.
    n = model_shape(r.recipe.model).num_params
    assert one.weights + one.gradients + one.master_weights + one.optimizer == pytest.approx(16 * n + bucket, abs=4)
    assert one.activations == eight.activations and one.logits == eight.logits


def test_zero_stages_shard_progressively(base):
    totals = [
        estimate_on(load(base, "distributed.engine=deepspeed", f"distributed.zero_stage={s}", nproc=8), 8).total
        for s in range(4)
    ]
    assert totals == sorted(totals, reverse=True) and totals[0] > 2 * totals[3]


def test_fsdp_shards_and_gathers_layers(base):
    r = load(base, "distributed.engine=fsdp", nproc=8)
    est = estimate_on(r, 8)
    n = model_shape(r.recipe.model).num_params
    assert est.weights == pytest.approx(4 * n / 8, abs=1)  # fp32 sharded, bf16 compute
    assert est.transient_weights > 0  # two gathered layers + the root
    kept = estimate_on(load(base, "distributed.engine=fsdp", "distributed.reshard_after_forward=false", nproc=8), 8)
    assert kept.transient_weights > 5 * est.transient_weights  # every layer stays gathered


def test_fsdp_grad_sync_micro_step_keeps_gradients_sharded(base):
    """Global 64 on 8 ranks at micro 1: accumulation 8. One reduce-scatter per step keeps the whole
    fp32 gradient (4 B x 8.03 B params = 30 GiB) between micro-steps; micro_step keeps a shard."""
    n = model_shape(load(base).recipe.model).num_params
    boundary = estimate_on(load(base, "distributed.engine=fsdp", nproc=8))
    every = estimate_on(load(base, "distributed.engine=fsdp", "distributed.fsdp_grad_sync=micro_step", nproc=8))
    assert boundary.gradients == 4 * n and every.gradients == pytest.approx(4 * n / 8, abs=1)
    note = next(t for t in boundary.notes if "fsdp_grad_sync=micro_step" in t)
    assert f"save {(4 * n - 4 * n / 8) / GIB:.1f} GiB" in note
    assert not any("fsdp_grad_sync" in t for t in every.notes)
    with pytest.raises(RecipeError, match="fsdp_grad_sync"):
        load(base, "distributed.engine=deepspeed", "distributed.fsdp_grad_sync=micro_step", nproc=8)


def test_offload_removes_state_from_gpu(base):
    r = load(
        base,
        "distributed.engine=deepspeed",
        "distributed.zero_stage=3",
        "distributed.offload_optimizer=cpu",
        "distributed.offload_params=cpu",
        nproc=8,
    )
    est = estimate_on(r, 8)
    assert est.optimizer == est.master_weights == est.weights == 0
    assert any("offloaded" in n for n in est.notes)


def test_optimizer_choices(base):
    def opt(*o):
        return estimate_on(load(base, *QLORA, *o), 1).optimizer

    adamw = opt()
    assert opt("optim.name=adamw_8bit") == adamw // 4
    assert opt("optim.name=sgd") == 0
    assert opt("optim.name=sgd", "optim.momentum=0.9") == adamw // 2


def test_activations_scale_with_micro_batch_and_checkpointing(base):
    r = load(base, "model.chunked_loss=false")
    one, four = estimate_on(r, 1, micro_batch_size=1), estimate_on(r, 1, micro_batch_size=4)
    assert four.activations == 4 * one.activations and four.logits == 4 * one.logits
    assert four.weights == one.weights
    ckpt = estimate_on(load(base, "model.gradient_checkpointing=true", "model.chunked_loss=false"), 1)
    assert ckpt.activations < one.activations / 10
    # Logits: 2048 tokens x 128256 vocab x 12 bytes: forward holds 2 bf16 + 4 fp32 copy + 4 fp32
    # log-softmax, backward the fp32 log-softmax and two fp32 gradients (the peak).
    assert one.logits == 2048 * 128256 * 12
    # The chunked loss (on by default here: 2048 tokens are more than one chunk) holds one chunk of
    # 2**24 // 128256 = 130 tokens, whatever the micro-batch.
    chunked = [estimate_on(load(base), 1, micro_batch_size=m) for m in (1, 4)]
    assert load(base).chunked_loss and all(c.logits == 130 * 128256 * 12 for c in chunked)


def test_quantized_bytes():
    assert quantized_bytes_per_param(4, False) == 0.5 + 4 / 64
    assert 0.51 < quantized_bytes_per_param(4, True) < 0.52
    assert quantized_bytes_per_param(8, True) == 1.0


def test_unknown_model_shape_is_a_user_error(base):
    r = load(base, "model.name_or_path=someone/unknown-model")
    with pytest.raises(UserError, match="config.json"):
        estimate_on(r, 1)
    with pytest.raises(UserError, match="config.json"):
        plan_command(base, ["model.name_or_path=someone/unknown-model"])


@functools.cache
def _lora_1b(path: str):
    return load(path, "model.name_or_path=meta-llama/Llama-3.2-1B", "peft.method=lora")


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 16),
    accumulation=st.integers(1, 64),
    gpu_gb=st.floats(1, 200),
)
def test_pick_micro_batch_keeps_the_equation_exact(base, dp, accumulation, gpu_gb):
    r = _lora_1b(base).recipe
    engine = choose_engine(r, dp)
    global_batch = dp * accumulation
    local = global_batch // dp
    try:
        micro = pick_micro_batch(r, engine, global_batch, dp, gpu_gb)
    except UserError as e:
        assert "even a micro-batch of 1" in str(e)
        assert not estimate(r, engine, dp, 1, local).fits(gpu_gb)
        return
    assert local % micro == 0 and micro * (local // micro) * dp == global_batch
    assert estimate(r, engine, dp, micro, local // micro).fits(gpu_gb)
    bigger = [d for d in divisors(local) if d > micro]
    assert all(not estimate(r, engine, dp, d, local // d).fits(gpu_gb) for d in bigger)


def test_pick_micro_batch_errors(base):
    r = load(base, *QLORA).recipe
    with pytest.raises(UserError, match="even a micro-batch of 1 needs about .* GiB"):
        pick_micro_batch(r, "single", 64, 1, 4)
    with pytest.raises(UserError, match="10 sequences do not split evenly over 4 .* global batch in \\{8, 12\\}"):
        pick_micro_batch(r, "ddp", 10, 4, 80)
    # micro auto needs the global batch: with both auto the solver asks for numbers
    with pytest.raises(RecipeError, match="are both auto"):
        load(
            base, *QLORA, "batch.global_batch_size=auto", "batch.micro_batch_size=auto", "distributed.gpu_memory_gb=80"
        )


def test_plan_command_table(base):
    text = plan_command(base, [*QLORA, "distributed.gpu_memory_gb=24"])
    assert "weights" in text and "logits" in text and "total" in text
    assert "fits in 24 GiB (distributed.gpu_memory_gb): yes" in text
    assert "largest micro-batch that fits and divides the local batch:" in text
    assert "micro 1 x accumulation 64 x data-parallel 1 = global 64" in text
    assert "NO" in plan_command(base, ["distributed.gpu_memory_gb=24"])


def test_plan_solves_micro_batch_auto(base):
    """micro_batch_size=auto (accumulation auto) is solved at load to what pick_micro_batch picks."""
    overrides = [*QLORA, "batch.micro_batch_size=auto", "distributed.gpu_memory_gb=24"]
    r = load(base, *overrides)
    b = r.batch
    assert r.recipe.batch.micro_batch_size == "auto"  # the recipe is intent: never changed
    assert b.micro_batch_size * b.gradient_accumulation_steps == 64
    assert b.micro_batch_size == pick_micro_batch(r.recipe, r.engine, 64, 1, 24) > 1
    assert f"micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps}" in plan_command(base, overrides)


def test_train_refuses_a_run_that_cannot_fit_before_loading(base, monkeypatch):
    """gpu_memory_gb set and the planner says no: `llmft train` fails with the numbers and the
    settings that would fit, before any model or data is touched."""
    from llmft.model import build as model_mod
    from llmft.training.train import train

    monkeypatch.setattr(model_mod, "build_model", lambda *a, **k: pytest.fail("loaded a model"))
    overrides = ["distributed.engine=fsdp", "distributed.gpu_memory_gb=80", "batch.micro_batch_size=8"]
    plan = load(base, *overrides, nproc=8)
    est = estimate_on(plan)
    assert est.total > 80 * GIB
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UserError) as e:
        from llmft.plan.memory import check_fits

        check_fits(plan)
    msg = str(e.value)
    assert f"{est.total / GIB:.1f} GiB per GPU" in msg and "more than 80 GiB" in msg
    assert "model.gradient_checkpointing=true" in msg and "batch.micro_batch_size=" in msg
    # and train() calls it first: with a world of 1 it resolves for one rank and still fails early
    with pytest.raises(UserError, match="more than 1 GiB"):
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        train(base, ["distributed.gpu_memory_gb=1", "distributed.engine=single"])


def test_host_memory_per_node_counts_how_the_model_is_loaded(base):
    """A pretrained QLoRA base under FSDP2 or ZeRO-3 is quantized block by block into each rank's
    part: one 4-bit copy per node, plus each rank's part of the tensor it is reading; ZeRO-3
    also allocates each parameter whole on the device for a moment (the embedding is the largest); a fresh
    4-bit model.config base is built whole on every rank (bitsandbytes quantizes on load); a LoRA
    base on the meta device needs about one copy per node."""
    from llmft.plan.memory import host_memory_per_node

    shape = model_shape(load(base).recipe.model)
    qlora = load(base, *QLORA, "distributed.engine=fsdp", nproc=8)
    assert qlora.meta_init
    p = count_params(qlora.recipe, shape)
    one_q = p.linear * quantized_bytes_per_param(4, True) + p.other * 2  # bf16 unquantized under FSDP2
    embedding = shape.vocab_size * shape.hidden_size * 2  # bf16: larger than any matrix of a layer
    assert embedding > p.largest_linear * 2
    assert host_memory_per_node(qlora) == pytest.approx(one_q + embedding, rel=1e-6)  # 8 ranks x 1/8 of it
    zero3 = load(base, *QLORA, "distributed.engine=deepspeed", "distributed.zero_stage=3", nproc=8)
    assert zero3.meta_init and not zero3.zero_init  # loaded partitioned from the meta device
    assert host_memory_per_node(zero3) == pytest.approx(one_q + embedding, rel=1e-6)
    # each parameter is allocated whole on the device for a moment: host RAM when the device is the
    # CPU, bar the frozen weights a CPU run reads in place (embedding, head, norms: the weight files'
    # pages), so the largest is a 4-bit matrix, read in the compute dtype
    on_cpu = host_memory_per_node(zero3, device_is_host=True)
    q = quantized_bytes_per_param(4, True)
    assert on_cpu == pytest.approx(p.linear * q + p.largest_linear * 2 + 8 * p.largest_linear * q, rel=1e-6)
    full = load(base, "distributed.engine=deepspeed", "distributed.zero_stage=3", nproc=8)  # trained: copied
    on_cpu = host_memory_per_node(full, device_is_host=True)
    assert on_cpu == pytest.approx(shape.num_params * 2 + embedding + 8 * embedding, rel=1e-6)
    config = "{model_type: llama, hidden_size: 4096, num_hidden_layers: 32, intermediate_size: 14336, "
    config += "num_attention_heads: 32, num_key_value_heads: 8, vocab_size: 128256}"
    fresh = load(base, *QLORA, "distributed.engine=deepspeed", "distributed.zero_stage=3", "model.name_or_path=null",
                 f"model.config={config}", nproc=8)  # fmt: skip
    assert fresh.zero_init and not fresh.meta_init  # above the whole-build threshold
    f = count_params(fresh.recipe, model_shape(fresh.recipe.model))
    one_fresh = f.linear * quantized_bytes_per_param(4, True) + f.other * 2
    assert host_memory_per_node(fresh) == pytest.approx(8 * one_fresh, rel=1e-6)  # bitsandbytes quantizes on load
    lora = load(base, "peft.method=lora", "distributed.engine=fsdp", nproc=8)
    assert host_memory_per_node(lora) == pytest.approx(shape.num_params * 2 + embedding, rel=1e-6)


def test_host_memory_per_rank_is_loading_with_a_gpu_and_the_step_too_on_a_cpu(base):
    """``llmft plan``'s host line: with a GPU a rank's share of the node's loading peak; on a
    CPU-only run the step's tensors are host memory too, and the larger phase is the peak."""
    from llmft.plan.memory import host_mapped_per_rank, host_memory_per_node, host_memory_per_rank
    from llmft.plan.report import host_line

    lora = load(base, "peft.method=lora", "distributed.engine=fsdp", nproc=8)
    assert host_memory_per_rank(lora) == host_memory_per_node(lora) // 8
    est = estimate_memory(lora)
    assert est.allocated > host_memory_per_node(lora, device_is_host=True) // 8  # the step is the peak here
    # A CPU run's FSDP2 gathers one unit at a time (engines/fsdp.py): the larger of attention and
    # MLP, twice (its all-gather output and the unsharded copy), not two layers and the root; the
    # frozen embedding and head are mapped whole from the weight files, never gathered.
    shape = model_shape(lora.recipe.model)
    a = DTYPE_BYTES[lora.recipe.model.dtype]
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    assert mlp > 4 * shape.hidden_size**2
    window = 2 * mlp * a
    # LoRA's frozen base shard stays in the weight files' pages (model/meta.py): page cache, not the
    # rank's own memory.
    assert lora.meta_init
    # The logits live from the head's forward to its backward, when no layer is gathered: the
    # larger of the two counts.
    on_cpu = est.allocated - est.transient_weights - est.logits + max(window, est.logits) - est.weights
    assert host_memory_per_rank(lora, device_is_host=True) == pytest.approx(on_cpu, abs=2)
    assert host_mapped_per_rank(lora) == pytest.approx(est.weights, abs=2)
    assert "of the weight files read in place, page cache)" in host_line(lora)
    # QLoRA: the 4-bit linears are quantized copies; the embedding, head and norms are mapped, and
    # one matrix is dequantized for its matmul.
    qlora = load(base, "peft.method=lora", "model.quantization={bits: 4}", "distributed.engine=fsdp", nproc=8)
    est = estimate_memory(qlora)
    params = count_params(qlora.recipe, shape)
    window = 2 * mlp * 0.5 + params.largest_linear * a  # 4-bit: half a byte per weight
    on_cpu = est.allocated - est.transient_weights - est.logits + max(window, est.logits) - params.other * a / 8
    assert host_memory_per_rank(qlora, device_is_host=True) == pytest.approx(on_cpu, abs=2)
    # A full fine-tune keeps the device estimate (units also hold their gradients while they reduce).
    full = load(base, "distributed.engine=fsdp", nproc=8)
    assert host_memory_per_rank(full, device_is_host=True) == estimate_memory(full).allocated


def test_the_steps_mmap_threshold_keeps_gathered_weights_mapped(base):
    """Single and DDP steps reuse the heap (32 MiB, fixed); FSDP2 and ZeRO-3 gather weights every
    step and keep 64 KiB, so a released one leaves the resident set (llmft/job/malloc.py)."""
    from llmft.job.malloc import MMAP_THRESHOLD, STEP_MMAP_THRESHOLD
    from llmft.plan.memory import step_mmap_threshold

    assert step_mmap_threshold(load(base, "peft.method=lora", "distributed.engine=fsdp", nproc=8)) == MMAP_THRESHOLD
    zero3 = load(base, *QLORA, "distributed.engine=deepspeed", "distributed.zero_stage=3", nproc=8)
    assert step_mmap_threshold(zero3) == MMAP_THRESHOLD
    assert step_mmap_threshold(load(base, "distributed.engine=ddp", nproc=8)) == STEP_MMAP_THRESHOLD == 32 << 20


def test_a_cpu_runs_zero3_host_line_counts_one_layer_gathered_not_the_live_window(base):
    """A CPU run's ZeRO-3 keeps about one layer gathered (plan.deepspeed.host_live_window): the
    host line counts the layer being computed, the prefetched next one and the LM head (kept from
    its forward to its backward) instead of the GPU's 1e9-parameter live window. A frozen weight of
    an adapter run is read whole from the weight files in place (model/zero3.py), never gathered:
    none of a LoRA base, a 4-bit base's layers gathered packed; a full fine-tune gathers all."""
    from llmft.plan.memory import host_gathered_bytes, host_mapped_per_rank, host_memory_per_node, host_memory_per_rank

    zero3 = ("distributed.engine=deepspeed", "distributed.zero_stage=3")
    full = load(base, *zero3, nproc=8)
    shape = model_shape(full.recipe.model)
    head = shape.vocab_size * shape.hidden_size * 2
    layer = shape.layer_linear_params * 2 + 2 * shape.hidden_size * 2  # bf16 linears and norms
    assert host_gathered_bytes(full) == pytest.approx(2 * layer + head, rel=1e-6)
    assert host_mapped_per_rank(full) == 0
    qlora = load(base, *QLORA, *zero3, nproc=8)
    assert host_gathered_bytes(qlora) == pytest.approx(
        2 * shape.layer_linear_params * quantized_bytes_per_param(4, True), rel=1e-6
    )
    lora = load(base, "peft.method=lora", *zero3, nproc=8)
    assert host_gathered_bytes(lora) == 0
    # a trained head (modules_to_save) is gathered, not read in place
    assert (
        host_gathered_bytes(load(base, "peft.method=lora", "peft.modules_to_save=[lm_head]", *zero3, nproc=8)) == head
    )

    gpu_step = estimate_memory(lora).allocated  # counts 1e9 bf16 parameters gathered (8B > 1e9)
    cpu_step = gpu_step - 10**9 * 2  # nothing gathered beside the logits
    # less the frozen base's partition, which is the weight files' pages
    on_cpu = cpu_step - estimate_memory(lora).weights
    assert on_cpu > host_memory_per_node(lora, device_is_host=True) // 8 - estimate_memory(lora).weights
    assert host_memory_per_rank(lora, device_is_host=True) == pytest.approx(on_cpu, abs=2)
    # the page cache it reads: the whole frozen base (bf16), not this rank's eighth of it
    assert host_mapped_per_rank(lora) == pytest.approx(count_params(lora.recipe, shape).base * 2, abs=2)

"""Memory per GPU of a recipe, before anything is loaded: ``llmft plan`` and ``micro_batch_size: auto``.

Pure arithmetic on the model shape (``plan.shape``): no torch, no download. The
estimate mirrors how llmft's engines hold a model (see ``engines/``):

- single / DDP / FSDP: trainable weights are upcast to fp32 (so their gradients and
  optimizer state are fp32 too) and autocast (or FSDP's MixedPrecisionPolicy) runs the
  matmuls in ``model.dtype``; frozen weights stay in ``model.dtype``. A trained fp32 embedding
  under autocast (single / DDP) makes the residual stream fp32 (``residual_bytes``).
- DeepSpeed: weights and gradients in ``model.dtype``, fp32 master weights beside the
  optimizer state (the ZeRO paper's 2 + 2 + 12 bytes per parameter for bf16 + Adam).
- QLoRA: the unquantized weights (embedding, head, norms) are frozen and stay in
  ``model.dtype`` on every engine (no fp32 copies of frozen weights: ``model.quant``).
- Long sequences (``activation_bytes``): sequence parallelism (the layout's ``sp``) divides a sequence's
  tokens over ranks, ``model.activation_offload`` moves the checkpointed layer inputs to host
  memory, ``model.tiled_mlp`` keeps one tile's MLP activations, the chunked loss one chunk's
  logits; ``longest_sequence`` is the longest ``max_seq_len`` that fits.

Every number is bytes on one GPU. Each component is exposed on its own so that
tests (and users) can compare them against a measured peak. "GB" in recipe keys
and output means GiB (2**30 bytes), the unit ``nvidia-smi`` and torch report in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from llmft.errors import Problem, UserError
from llmft.job.malloc import MMAP_THRESHOLD, STEP_MMAP_THRESHOLD
from llmft.plan.batch import divisors
from llmft.plan.deepspeed import DTYPE_BYTES, ZERO3_MAX_LIVE_PARAMETERS, persistence_threshold, reduce_bucket_bytes
from llmft.plan.dims import SEQUENCE
from llmft.plan.engines import engine_spec
from llmft.plan.layout import ParallelLayout, RunPlan, layout_of
from llmft.plan.moe import packs_experts
from llmft.plan.objectives import (
    FROZEN_COPY,
    NO_REFERENCE,
    REFERENCE_MODEL,
    REWARD_MODEL,
    ObjectiveSpec,
    objective_of,
    reference_kind,
)
from llmft.plan.rl import GenerationKV, generation_kv, parse_rewards
from llmft.plan.shape import ModelShape, linear_shapes, model_shape, reward_model_shape, safetensors_bytes
from llmft.recipe.schema import Recipe

GIB = 2**30

# 4-bit NF4 packs two weights per byte; each block of 64 weights has an absmax constant:
# fp32 (4 / 64 B/param), or with double quantization an 8-bit constant plus one fp32
# constant per 256 blocks (1 / 64 + 4 / (64 * 256)). bitsandbytes' defaults (QLoRA paper, 2.1).
NF4_BLOCK, NF4_BLOCK2 = 64, 256
# LLM.int8: one byte per weight plus an fp32 scale per output row (negligible, ignored).
INT8_BYTES = 1.0

# Optimizer state per trainable parameter: AdamW m and v in fp32; bitsandbytes' 8-bit Adam
# keeps both in 8 bits (block constants ignored); SGD keeps fp32 momentum when it has any.
OPTIMIZER_BYTES = {"adamw": 8, "paged_adamw": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2}

# CUDA context, cuBLAS / NCCL workspaces (not seen by torch's allocator but taken from the
# card), and a margin for the caching allocator's fragmentation of everything else.
CUDA_CONTEXT_BYTES = GIB // 2
FRAGMENTATION = 0.05

# Chunked loss (llmft/model/loss.py): rows of the LM head computed at once, so that one chunk's fp32
# logits are about 64 MiB (2**24 elements): 524 tokens at vocab 32k, 131 at vocab 128k.
LOSS_CHUNK_ELEMENTS = 2**24
# Bytes per logit at the cross-entropy's backward: the saved fp32 log-softmax and two fp32 gradients.
LOSS_BACKWARD_BYTES = 12

# LoRA "all-linear" on a Llama-style decoder, and each module's (in, out) features.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_LINEARS = ALL_LINEAR[4:]


@dataclass(frozen=True)
class Params:
    """Parameter counts of the model as llmft would train it."""

    linear: int  # decoder linears (what quantization applies to)
    other: int  # embedding, LM head, norms: never quantized
    layer: int  # one decoder layer (linears, routed experts and router, norms; the mean of the layers)
    adapters: int  # LoRA A/B (+ DoRA magnitudes): fp32
    saved: int  # modules_to_save: a trainable fp32 copy beside the frozen original
    adapted_inputs: int  # sum of in_features over adapted linears of one layer (activation cost)
    adapted_mlp_inputs: int  # the part of adapted_inputs that feeds the MLP's linears
    largest_linear: int  # largest single weight matrix of a layer
    # A mixture of experts' routed experts and routers, every one of them (memory counts the total
    # parameters): fused [experts, ., .] tensors that LoRA leaves frozen.
    experts: int = 0
    # The fused routed expert weights alone (``experts`` less the routers): 4-bit under 4-bit QLoRA
    # (``llmft.model.moe_quant``); the routers stay in the compute dtype.
    expert_weights: int = 0

    @property
    def base(self) -> int:
        return self.linear + self.other + self.experts


def _targets(target_modules: str | list[str], linears: dict[str, tuple[int, int]]) -> list[str]:
    """The linears of ``linears`` (``linear_shapes``: a mixture of experts may have no MLP linears) adapted."""
    if target_modules == "all-linear":
        return [m for m in ALL_LINEAR if m in linears]
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    # PEFT matches module names by suffix ("self_attn.q_proj" and "q_proj" both adapt q_proj).
    return [m for m in ALL_LINEAR if m in linears and any(n == m or n.endswith("." + m) for n in names)]


def count_params(recipe: Recipe, shape: ModelShape) -> Params:
    h, n_layers = shape.hidden_size, shape.num_layers
    linears = linear_shapes(shape)
    embed = shape.vocab_size * h
    head = shape.embedding_params - embed
    experts = shape.expert_params + shape.router_params
    norms = shape.norm_params
    adapters = saved = adapted_inputs = adapted_mlp_inputs = 0
    p = recipe.peft
    if p.method != "none":
        targets = _targets(p.target_modules, linears)
        adapters = n_layers * sum(_adapter_tensors(recipe, shape))
        adapted_inputs = sum(linears[t][0] for t in targets)
        adapted_mlp_inputs = sum(linears[t][0] for t in targets if t in MLP_LINEARS)
        for name in p.modules_to_save or ():
            saved += {"lm_head": head or embed, "embed_tokens": embed}.get(name.rsplit(".", 1)[-1], h)
        e = shape.experts
        # LoRA on the fused experts (as llmft.plan.moe.experts_adapted: null is on under lora): an A
        # (r x in) and a B (out x r) per expert of gate_up_proj (hidden -> 2 ffn) and down_proj (ffn -> hidden).
        if e is not None and (p.target_experts if p.target_experts is not None else p.method == "lora"):
            adapters += e.num_layers * e.num_experts * p.r * (2 * h + 3 * e.ffn)
        if e is not None and p.train_router:
            saved += shape.router_params
    return Params(
        linear=shape.linear_params,
        other=embed + head + norms,
        layer=(shape.linear_params + experts + norms - h) // n_layers,
        adapters=adapters,
        saved=saved,
        adapted_inputs=adapted_inputs,
        adapted_mlp_inputs=adapted_mlp_inputs,
        largest_linear=max(i * o for i, o in linears.values()),
        experts=experts,
        expert_weights=shape.expert_params,
    )


def _adapter_tensors(recipe: Recipe, shape: ModelShape) -> list[int]:
    """The elements of each adapter tensor of one decoder layer: LoRA's A and B of every target
    (+ DoRA's magnitudes, one per output feature); none without PEFT."""
    p = recipe.peft
    if p.method == "none":
        return []
    linears = linear_shapes(shape)
    targets = _targets(p.target_modules, linears)
    tensors = [n for t in targets for n in (p.r * linears[t][0], p.r * linears[t][1])]
    if p.method == "dora":
        tensors += [linears[t][1] for t in targets]
    return tensors


def _persistent_adapters(recipe: Recipe, shape: ModelShape) -> int:
    """The adapter parameters ZeRO-3 keeps whole on every rank (at most
    ``plan.deepspeed.persistence_threshold``, 10 x hidden, elements each: at r 8 every A that
    reads the hidden size and every B that writes it; at r 16 and up only the narrower ones; DoRA's
    magnitudes)."""
    limit = persistence_threshold(shape)
    return shape.num_layers * sum(n for n in _adapter_tensors(recipe, shape) if n <= limit)


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss for a vocabulary of ``vocab_size``."""
    return max(1, LOSS_CHUNK_ELEMENTS // max(vocab_size, 1))


def chunked_loss_on(recipe: Recipe, micro_batch_size: int) -> bool:
    """Whether the run computes the loss in chunks. ``model.chunked_loss: auto``: when a
    micro-batch has more tokens than one chunk (where it helps); unknown shape: on."""
    if recipe.model.liger_kernels:  # Liger's fused linear cross-entropy chunks the loss itself (CUDA)
        return False
    spec = objective_of(recipe)
    if spec.head != "lm":  # a scalar score head has no vocabulary to chunk
        return False
    if recipe.model.chunked_loss != "auto":
        return bool(recipe.model.chunked_loss)
    shape = model_shape(recipe.model)
    if shape is None:
        return True
    rows = micro_batch_size * spec.rows(recipe)
    return rows * recipe.data.max_seq_len > loss_chunk_tokens(shape.vocab_size)


def quantized_bytes_per_param(bits: int, double_quant: bool) -> float:
    if bits == 8:
        return INT8_BYTES
    constants = 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_BLOCK2) if double_quant else 4 / NF4_BLOCK
    return 0.5 + constants


def activation_bytes_per_token_layer(
    shape: ModelShape, act_bytes: int, adapted_inputs: int, eager_seq: int, residual: int | None = None
) -> int:
    """What one decoder layer saves for backward, per token (no recomputation).

    A tally in the spirit of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
    Large Transformer Models", sec. 4.1: 34 * h bytes per token for a GPT layer in 16 bit),
    redone for a Llama layer with SDPA (no s x s scores kept) and no dropout, a = act_bytes:

    - 2 RMSNorms: HF computes them in fp32 (keeps the fp32 input, 4h) and keeps the cast
      output and the weighted output (2 a h): (4 + 2a) h each. With an fp32 residual stream
      (``residual_bytes``: 4) the input is fp32 already and the norm's weighted output is fp32, cast
      to ``a`` by autocast for the next matmul: the fp32 input (of the second norm: the attention's
      residual sum), the normalised and the weighted fp32 values and the cast copy, 14h and 10h for
      the two norms, (4 + 2 x 4) h each on average;
    - attention: q, k, v after RoPE (a (h + 2 kv)), the SDPA output and the o_proj input
      (2 a h);
    - SwiGLU MLP: gate output, silu(gate), up output, and their product (4 a i);
    - LoRA: PEFT casts each adapted module's input to the adapter dtype (fp32) and autocast casts
      it back, a copy per adapted module: a * (sum of their in_features); none in an fp32 model,
      where both casts are no-ops (the adapter saves the tensor the base layer saved);
    - eager attention only: the scores and the softmax (2 a * heads * seq).
    """
    h, kv, i = shape.hidden_size, shape.num_kv_heads * shape.head_dim, shape.mlp_width_per_token
    r = act_bytes if residual is None else residual
    norms = 2 * (4 + 2 * r) * h
    attention = act_bytes * (h + 2 * kv) + 2 * act_bytes * h
    mlp = 4 * act_bytes * i
    lora = act_bytes * adapted_inputs if act_bytes < 4 else 0
    eager = 2 * act_bytes * shape.num_heads * eager_seq
    return norms + attention + mlp + lora + eager


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU, by component. ``total`` is what must fit."""

    weights: int  # the base model's weights resident on this GPU (this rank's shard)
    adapters: int  # LoRA / DoRA weights and modules_to_save copies (fp32)
    gradients: int  # of the trainable parameters (+ DDP's bucket copies, DeepSpeed's reduce buckets)
    optimizer: int  # optimizer state
    master_weights: int  # DeepSpeed's fp32 copy of 16-bit trainable weights
    transient_weights: int  # gathered layers (FSDP / ZeRO-3), autocast copies, dequantized 4-bit matrices
    activations: int  # saved for backward, for micro_batch_size x rows per item x max_seq_len tokens
    logits: int  # the LM head output and the fp32 loss over it
    reference: int  # a preference run's frozen reference weights, and its forward beyond the policy's
    overhead: int  # CUDA context + allocator fragmentation
    micro_batch_size: int
    seq_len: int
    dp_size: int
    engine: str
    notes: tuple[str, ...] = field(default=())
    rows_per_item: int = 1  # sequences per item of the micro-batch: 2 for preference pairs
    reward_models: int = 0  # online RL: the reward models' weights (``reward_model_sizes``), placed like the policy's
    generation: int = 0  # online RL: generation's KV cache beyond the step's own working set (``generation_kv``)

    COMPONENTS: ClassVar[tuple[str, ...]] = (
        "weights",
        "adapters",
        "gradients",
        "optimizer",
        "master_weights",
        "transient_weights",
        "activations",
        "logits",
        "reference",
        "reward_models",
        "generation",
        "overhead",
    )
    # Rows of the table shown only where they hold something (an SFT table stays as it was); the
    # reference row is a preference run's always.
    OPTIONAL: ClassVar[tuple[str, ...]] = ("reference", "reward_models", "generation")

    @property
    def total(self) -> int:
        return sum(b for _, b in self.components())

    @property
    def allocated(self) -> int:
        """The tensors alone: what torch's allocator counts at its peak
        (``torch.cuda.max_memory_allocated``, the number torchtune and most papers publish), without
        the CUDA context and the caching allocator's fragmentation (``overhead``)."""
        return self.total - self.overhead

    def components(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in self.COMPONENTS]

    def fits(self, gpu_memory_gb: float) -> bool:
        return self.total <= gpu_memory_gb * GIB


def _require_shape(recipe: Recipe) -> ModelShape:
    shape = model_shape(recipe.model)
    if shape is None:
        raise UserError(
            Problem(
                "model.name_or_path",
                f"the shape of {recipe.model.name_or_path!r} cannot be known without its config.json "
                "(not a local directory, not in the Hugging Face cache, not a model llmft knows)",
                "Download its config.json first (huggingface-cli download NAME config.json) or pass a local "
                "model directory; where no estimate is possible, give batch.micro_batch_size a number, not auto.",
            )
        )
    return shape


@dataclass(frozen=True)
class _Layout:
    """How many ways each kind of state is divided, and what lives off the GPU."""

    weights: int = 1
    gradients: int = 1
    optimizer: int = 1
    weights_on_gpu: bool = True
    optimizer_on_gpu: bool = True
    grads_on_gpu: bool = True


def _as_layout(recipe: Recipe, engine: str, parallel: ParallelLayout | int) -> ParallelLayout:
    """The run's parallel layout; given a number of data-parallel ranks instead (a caller without a
    resolved plan), those ranks with every other dimension as the recipe asks (``layout_of``)."""
    if isinstance(parallel, ParallelLayout):
        return parallel
    return layout_of(recipe, engine_spec(engine), parallel)


def _layout(recipe: Recipe, engine: str, parallel: ParallelLayout) -> _Layout:
    d = recipe.distributed
    spec = engine_spec(engine)
    sharding = spec.sharding_for(d.zero_stage)
    # The ranks of a sequence-parallel group hold the same weights, so ZeRO (ALST partitions over
    # the whole world) and FSDP2 (a data-shard x sequence mesh) shard over them too; HSDP shards
    # within a replica group.
    group = parallel.shard_group
    params_on_gpu = d.offload_params == "none" or not spec.param_offload
    optimizer_on_gpu = d.offload_optimizer == "none" or not spec.optimizer_offload
    return _Layout(
        weights=group if sharding.params else 1,
        gradients=group if sharding.gradients else 1,
        optimizer=group if sharding.optimizer else 1,
        weights_on_gpu=params_on_gpu,
        # FSDP2's CPUOffloadPolicy keeps params, grads and optimizer state on the CPU (step runs there).
        optimizer_on_gpu=params_on_gpu and optimizer_on_gpu if spec.offload_moves_all else optimizer_on_gpu,
        grads_on_gpu=params_on_gpu if spec.offload_moves_all else True,
    )


def estimate_memory(plan: RunPlan, micro_batch_size: int | None = None) -> MemoryEstimate:
    """Peak bytes per GPU of a resolved run (``micro_batch_size`` overrides the plan's)."""
    micro = micro_batch_size if micro_batch_size is not None else plan.batch.micro_batch_size
    return estimate(plan.recipe, plan.engine, plan.layout, micro, plan.batch.gradient_accumulation_steps)


def estimate(
    recipe: Recipe, engine: str, parallel: ParallelLayout | int, micro: int, accumulation: int
) -> MemoryEstimate:
    """Peak bytes per GPU for ``recipe`` on ``engine`` laid out as ``parallel`` (the plan's
    ``ParallelLayout``, or a number of data-parallel ranks: ``_as_layout``)."""
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise UserError(
            Problem("batch.micro_batch_size", f"{micro!r} is not a number to estimate memory for", "Give a number.")
        )
    shape = _require_shape(recipe)
    params = count_params(recipe, shape)
    a = DTYPE_BYTES[recipe.model.dtype]
    parallel = _as_layout(recipe, engine, parallel)

    states = _states(recipe, engine, params, a)
    layout = _layout(recipe, engine, parallel)
    placed = {
        "weights": _placed(states["weights"], layout.weights, layout.weights_on_gpu),
        "adapters": _placed(states["adapters"], layout.weights, layout.weights_on_gpu),
        # FSDP2 with gradient sync off keeps each micro-step's gradients unsharded until the
        # boundary reduce-scatter, so with accumulation they are not divided by the shards
        # (distributed.fsdp_grad_sync=micro_step reduce-scatters every micro-step instead).
        "gradients": _placed(
            states["gradients"],
            1 if unsharded_accumulation(recipe, engine, accumulation) else layout.gradients,
            layout.grads_on_gpu,
        ),
        "optimizer": _placed(states["optimizer"], layout.optimizer, layout.optimizer_on_gpu),
        "master_weights": _placed(states["master_weights"], layout.optimizer, layout.optimizer_on_gpu),
    }
    _expert_parallel(recipe, shape, params, states, layout, parallel, placed, a)
    if engine_spec(engine).zero_stages and layout.grads_on_gpu:
        placed["gradients"] += reduce_bucket_bytes(recipe, shape)  # DeepSpeed's reduce buckets
    if engine_spec(engine).param_gather == "live_window" and layout.weights > 1:
        # whole on the device beside their partitions, offload_param or not (partition_parameters.py)
        placed["adapters"] += _persistent_adapters(recipe, shape) * 4
    spec = objective_of(recipe)
    tokens = spec.rows(recipe) * tokens_per_rank(recipe, micro, parallel.sp)  # a pair is two sequences
    placed["transient_weights"] = _transient_weights(recipe, engine, shape, params, a, states["weights"])
    # Forward holds the head's output in the compute dtype, its fp32 copy for the loss and the fp32
    # log-softmax cross-entropy keeps (a + 8 bytes per logit); backward the saved log-softmax, its
    # incoming gradient and the gradient it returns, all fp32 (12: the peak, the compute-dtype
    # logits being freed by then; measured on CPU in bf16, tests/unit/test_long_context.py). For the
    # whole micro-batch, or one chunk of the chunked loss (llmft/model/loss.py recomputes one at a time).
    # Liger's fused loss chunks SFT's too, not the preference log-probs.
    chunked = chunked_loss_on(recipe, micro) or (recipe.model.liger_kernels and not spec.pairs)
    logit_rows = min(tokens, loss_chunk_tokens(shape.vocab_size)) if chunked else tokens
    placed["logits"] = logit_rows * shape.vocab_size * max(a + 8, LOSS_BACKWARD_BYTES)
    placed["activations"] = _activations(
        recipe, shape, params, tokens, a, placed["logits"], residual_bytes(recipe, engine, a), parallel.sp
    ) + all_to_all_bytes(shape, parallel, tokens, a)
    reference_weights = _placed(_frozen_copy(recipe, engine, params, a), layout.weights, layout.weights_on_gpu)
    placed["reference"] = _reference(recipe, shape, params, tokens, a, placed, reference_weights)
    rewards = reward_model_sizes(recipe, spec)
    # Held as the policy's weights are (``Engine.place_frozen``): sharded under FSDP2 / ZeRO-3, offloaded with them.
    placed["reward_models"] = _placed(sum(n for _, n, _ in rewards), layout.weights, layout.weights_on_gpu)
    kv = generation_kv(recipe, spec, shape, micro * accumulation)
    # Generation runs before the step's forward and its cache is freed when it returns: the peak is
    # the larger of the two working sets (the step's: activations, logits, the reference's forward).
    step_working_set = placed["activations"] + placed["logits"] + placed["reference"] - reference_weights
    engine_bytes, engine_note = colocated_engine(recipe, spec, params, a)
    generation_peak = max(kv.nbytes if kv is not None else 0, engine_bytes)
    placed["generation"] = max(generation_peak - step_working_set, 0)
    placed["overhead"] = CUDA_CONTEXT_BYTES + FRAGMENTATION * sum(placed.values())

    notes = _generation_notes(kv, step_working_set, engine_bytes, engine_note)
    held = f"sharded over {layout.weights} ranks like the policy" if layout.weights > 1 else "whole on every GPU"
    for path, nbytes, source in rewards:
        notes.append(f"reward model {path}: {nbytes / GIB:.2f} GiB ({source}), {held}")
    if unsharded_accumulation(recipe, engine, accumulation) and layout.gradients > 1:
        saved = placed["gradients"] * (1 - 1 / layout.gradients)
        notes.append(
            f"distributed.fsdp_grad_sync=micro_step would keep gradients sharded while accumulating and save "
            f"{saved / GIB:.1f} GiB, for a reduce-scatter every micro-step"
        )
    mask = packed_mask_bytes(recipe, tokens, parallel.sp)
    if mask >= MASK_NOTE_BYTES:
        notes.append(
            f"sdpa keeps packed rows apart with a T x T mask per row ({mask / GIB:.2f} GiB, in activations); "
            "model.attn_implementation=auto (varlen_sdpa, or flash_attention_2 where flash-attn is installed) needs none"
        )
    if recipe.optim.name.startswith("paged"):
        notes.append("paged optimizer state is counted on the GPU; under pressure it pages to CPU RAM")
    if not layout.optimizer_on_gpu or not layout.weights_on_gpu:
        notes.append("offloaded state is in CPU RAM, not counted here")
    return MemoryEstimate(
        **{k: int(round(v)) for k, v in placed.items()},
        micro_batch_size=micro,
        seq_len=recipe.data.max_seq_len,
        dp_size=parallel.dp_size,
        engine=engine,
        notes=tuple(notes),
        rows_per_item=spec.rows(recipe),
    )


def _expert_parallel(
    recipe: Recipe,
    shape: ModelShape,
    params: Params,
    states: dict[str, float],
    layout: _Layout,
    parallel: ParallelLayout,
    placed: dict[str, float],
    a: int,
) -> None:
    """``distributed.expert_parallel: n`` (``llmft.model.expert_parallel``): each rank holds E / n whole
    experts, which FSDP2 does not shard further, so their share of the weights (and, when trained, of
    the gradients and optimizer state) is divided by n, not by the shard group; and each MoE layer's
    forward holds its tokens' K rows four times (sent, received, computed, returned) while it runs."""
    n, e = parallel.size("ep"), shape.experts
    if n <= 1 or e is None or not params.expert_weights:
        return
    share = params.expert_weights / max(params.base, 1)
    held = {"weights": layout.weights}
    if recipe.peft.method == "none":
        held.update(gradients=layout.gradients, optimizer=layout.optimizer, master_weights=layout.optimizer)
    for key, shards in held.items():
        part = states[key] * share
        on = layout.weights_on_gpu if key == "weights" else layout.optimizer_on_gpu
        placed[key] += _placed(part, n, on) - _placed(part, shards, on)


def all_to_all_bytes(shape: ModelShape, parallel: ParallelLayout, tokens: int, a: int) -> int:
    """Expert parallelism's exchange buffers while one MoE layer runs: its tokens' K rows sent,
    received, computed and returned (4 x tokens x K x hidden); 0 without it."""
    e = shape.experts
    if parallel.size("ep") <= 1 or e is None:
        return 0
    return 4 * tokens * e.top_k * shape.hidden_size * a


def unsharded_accumulation(recipe: Recipe, engine: str, accumulation: int) -> bool:
    """FSDP2 accumulating with one reduce-scatter per step: the gradients are whole until then."""
    honoured = engine_spec(engine).honours("distributed.fsdp_grad_sync")
    return honoured and accumulation > 1 and recipe.distributed.fsdp_grad_sync == "boundary"


def _states(recipe: Recipe, engine: str, params: Params, a: int) -> dict[str, float]:
    """Weights, gradients and optimizer state of the whole model, before sharding or offload.

    Trainable weights are fp32 (``upcast_trainable``), except under DeepSpeed, which keeps
    them in the compute dtype beside an fp32 master copy. ZeRO 1-3 keep that copy in an fp32 run
    too: stage 1-2 clone the partition whatever its dtype, and stage 3 shares it only when the
    partition's ``torch.device`` equals the accelerator's device name, a string, which it never
    does (deepspeed 0.19 ``_create_fp32_partitions``; found on CPU: bench/load_memory.py).
    """
    m, peft = recipe.model, recipe.peft.method != "none"
    spec = engine_spec(engine)
    low = spec.low_precision_weights
    if m.quantization is not None:
        # The unquantized weights are frozen and stay in the compute dtype (model.quant.prepare_kbit).
        packed = _packed_experts(recipe, params, engine)
        weights = (params.linear + packed) * quantized_bytes_per_param(m.quantization.bits, m.quantization.double_quant)
        weights += (params.other + params.experts - packed) * a  # norms, embedding, head, routers
    elif peft:
        weights = params.base * a  # frozen
    else:
        weights = params.base * (a if low else 4)
    trainable = params.adapters + params.saved if peft else params.base
    gradients = trainable * (a if low else 4) * spec.gradient_copies  # DDP's flat buckets are a second copy
    return {
        "weights": weights,
        "adapters": trainable * 4 if peft else 0,
        "gradients": gradients,
        "optimizer": trainable * _optimizer_bytes(recipe),
        "master_weights": trainable * 4 if low and (a < 4 or recipe.distributed.zero_stage) else 0,
    }


def _frozen_copy(recipe: Recipe, engine: str, params: Params, a: int) -> float:
    """Weights of a separate frozen reference model (all of them, before sharding): a full
    fine-tune's copy of the policy, or the model ``preference.reference`` names (counted at the
    policy's shape), built like a policy without adapters. 0 when the run holds none."""
    if recipe.preference.precompute_reference or reference_kind(recipe) not in (FROZEN_COPY, REFERENCE_MODEL):
        return 0.0
    return _states(replace(recipe, peft=replace(recipe.peft, method="none")), engine, params, a)["weights"]


def _reference(
    recipe: Recipe, shape: ModelShape, params: Params, tokens: int, a: int, placed: dict, weights: float
) -> float:
    """A preference run's reference on this GPU: its frozen weights (``weights``, placed), and what its
    no-grad forward holds beyond the policy's peak. That forward runs first and keeps only the
    sequences' log-probs, so its working set (the head's output as the policy's, and one layer's
    activations) is gone before the policy saves anything: it raises the peak only where it is larger
    than the policy's saved activations and logits. None with ``preference.precompute_reference`` or
    a reference-free loss (``RunPlan.reference``: none); LoRA's adapters-disabled reference holds no
    weights of its own."""
    if recipe.preference.precompute_reference or reference_kind(recipe) == NO_REFERENCE:
        return 0.0
    eager_seq = recipe.data.max_seq_len if recipe.model.attn_implementation == "eager" else 0
    layer = activation_bytes_per_token_layer(shape, a, params.adapted_inputs, eager_seq) * tokens
    forward = placed["logits"] + layer
    return weights + max(forward - placed["activations"] - placed["logits"], 0.0)


def _generation_notes(
    kv: GenerationKV | None, step_working_set: float, engine_bytes: int, engine_note: str
) -> list[str]:
    """What the plan says of online RL's generation: ``hf``'s KV cache, or the colocated vLLM engine."""
    notes: list[str] = []
    if kv is not None:
        notes.append(
            f"generation's KV cache: {kv.nbytes / GIB:.2f} GiB ({kv.describe()}); it is freed before the step's "
            f"forward, so the generation row counts only what it holds beyond the step's activations, logits "
            f"and reference forward ({max(kv.nbytes - step_working_set, 0) / GIB:.2f} GiB)"
        )
    if engine_note:
        notes.append(
            f"{engine_note}; it sleeps (its memory released) while the model updates, so the generation row "
            f"counts what it holds beyond the step's activations, logits and reference forward "
            f"({max(engine_bytes - step_working_set, 0) / GIB:.2f} GiB); where it does not fit, lower "
            "rollout.vllm.gpu_memory_utilization (or set rollout.vllm.kv_cache_gib), or serve the engine on other "
            "GPUs (rollout.vllm.mode: server)"
        )
    return notes


def colocated_engine(recipe: Recipe, spec: ObjectiveSpec, params: Params, a: int) -> tuple[int, str]:
    """The colocated vLLM engine's memory on each GPU while it generates (``rollout.vllm.mode:
    colocate``) and what the plan says of it; (0, "") for every other run. vLLM takes
    ``gpu_memory_utilization`` of the GPU for the weights (a copy in the compute dtype, split over
    ``rollout.vllm.tensor_parallel_size`` ranks), its KV cache and its working set; with
    ``rollout.vllm.kv_cache_gib`` it takes the weights and that cache."""
    r = recipe.rollout
    if not spec.reads_from("rollout") or r.backend != "vllm" or r.vllm.mode != "colocate":
        return 0, ""
    weights = ((params.linear + params.other) * a + params.adapters * 4) // max(r.vllm.tensor_parallel_size, 1)
    v, gpu = r.vllm, recipe.distributed.gpu_memory_gb
    if v.kv_cache_gib:
        total = weights + int(v.kv_cache_gib * GIB)
        return total, (
            f"the colocated vLLM engine: {total / GIB:.2f} GiB while it generates (the weights, "
            f"{weights / GIB:.2f} GiB, and rollout.vllm.kv_cache_gib {v.kv_cache_gib:g})"
        )
    if not isinstance(gpu, (int, float)):
        return weights, (
            f"the colocated vLLM engine: at least its weights, {weights / GIB:.2f} GiB, while it generates, and "
            f"rollout.vllm.gpu_memory_utilization {v.gpu_memory_utilization:g} of the GPU (set "
            "distributed.gpu_memory_gb to count it, or rollout.vllm.kv_cache_gib)"
        )
    total = max(int(v.gpu_memory_utilization * gpu * GIB), weights)
    return total, (
        f"the colocated vLLM engine: {total / GIB:.2f} GiB while it generates (rollout.vllm.gpu_memory_utilization "
        f"{v.gpu_memory_utilization:g} of {gpu:g} GiB: its weights, {weights / GIB:.2f} GiB, KV cache and working set)"
    )


def reward_model_sizes(recipe: Recipe, spec: ObjectiveSpec) -> list[tuple[str, int, str]]:
    """``(path, bytes, where the number comes from)`` of each reward model ``rewards`` names, for an
    objective whose record lists ``REWARD_MODEL`` among its frozen models; [] for every other run.

    ``objectives/rewards.py`` loads each in the dtype its weights are stored in (the engine then holds
    it as it holds the policy's weights, ``Engine.place_frozen``; ``estimate`` places the bytes):
    the bytes of its safetensors files; without them (a hub id, a .bin checkpoint) its config's
    parameters as a sequence classifier (no LM head, a one-row score head) in ``model.dtype``; 0
    where neither can be read (a note says so)."""
    if REWARD_MODEL not in spec.frozen:
        return []
    try:
        entries = parse_rewards(list(recipe.rewards or ()))
    except UserError:
        return []  # refused by the recipe check, with the entry named
    out = []
    for kind, path, _ in entries:
        if kind != "model":
            continue
        try:
            nbytes = safetensors_bytes(Path(path).expanduser())
        except (OSError, ValueError):
            nbytes = None  # a damaged file: the recipe check names it
        if nbytes is not None:
            out.append((path, nbytes, "its safetensors"))
            continue
        shape = reward_model_shape(path)
        if shape is None:
            out.append((path, 0, "size unknown: no safetensors or config.json here, not counted"))
            continue
        h = shape.hidden_size
        params = shape.num_params - shape.embedding_params + shape.vocab_size * h + h
        out.append((path, params * DTYPE_BYTES[recipe.model.dtype], f"its config: {params:,} parameters"))
    return out


def _placed(nbytes: float, shards: int, on_gpu: bool) -> float:
    return nbytes / shards if on_gpu else 0.0


def _optimizer_bytes(recipe: Recipe) -> int:
    o = recipe.optim
    if o.name == "sgd":
        return 4 if o.momentum > 0 else 0
    return OPTIMIZER_BYTES[o.name]


def _transient_weights(recipe: Recipe, engine: str, shape: ModelShape, params: Params, a: int, weights: float) -> float:
    """Weights that exist only during forward/backward, beyond the resident ones."""
    m, d = recipe.model, recipe.distributed
    peft = recipe.peft.method != "none"
    per_param = weights / max(params.base, 1)  # resident bytes per base param (quantized or not)
    gather = per_param if m.quantization is not None else a  # what a gathered layer costs
    spec = engine_spec(engine)
    gathered = spec.param_gather if spec.shards_parameters(recipe) else None
    out = 0.0
    if gathered == "per_layer":
        # The current layer and the prefetched next one are unsharded; the root (embedding,
        # head) stays gathered from forward to backward. FSDP without reshard keeps every layer.
        layers = shape.num_layers if not d.reshard_after_forward else min(2, shape.num_layers)
        out += (layers * params.layer + params.other) * gather
    elif gathered == "live_window":
        # DeepSpeed releases a gathered parameter only when it is next used more than
        # stage3_max_reuse_distance parameters later and more than stage3_max_live_parameters are
        # live (both 1e9 on a GPU, as HF's auto sets them): up to 1e9 parameters stay gathered
        # between forward and backward, the whole model when it is smaller. A CPU run bounds both
        # to a layer (host_memory_per_rank counts that instead).
        out += _live_window(params, gather)
    elif spec.autocast_weight_cache and not peft and a < 4:
        out += params.base * a  # autocast's cached compute-dtype copy of every fp32 weight
    return out + _matrix_transients(recipe, params, a)


def _matrix_transients(recipe: Recipe, params: Params, a: int) -> float:
    """Whole weight matrices made for one matmul, on any engine."""
    out = 0.0
    quant = recipe.model.quantization
    if quant is not None and quant.bits == 4:
        out += params.largest_linear * a  # one matrix dequantized for its matmul
    if recipe.peft.method == "dora":
        out += 2 * params.largest_linear * 4  # DoRA materialises W + BA to take its column norms
    return out


def residual_bytes(recipe: Recipe, engine: str, a: int) -> int:
    """Bytes per value of the residual stream: the hidden states between the sublayers, which the
    checkpointed layer inputs, the RMSNorms and the embedding output hold.

    The stream takes the embedding weight's dtype (the embedding is no autocast op, and autocast
    leaves the residual additions alone: an fp32 tensor plus a bf16 matmul output is fp32). Where an
    engine trains fp32 weights under autocast (``EngineSpec.autocast_weight_cache``: single, DDP) and
    the embedding is trained (a full fine-tune, or ``embed_tokens`` in ``peft.modules_to_save``), the
    stream is fp32 although every matmul runs in the compute dtype: 4 bytes, not ``a``. Measured on
    an H200 (tests/gpu/test_long_context_gpu.py, a full fine-tune in bf16): counting the layer inputs
    in bf16 left the planner 1.28x (offload) and 1.49x (tiled MLP) under the peak."""
    if a >= 4 or not engine_spec(engine).autocast_weight_cache or recipe.model.quantization is not None:
        return a
    p = recipe.peft
    saved = [str(n).rsplit(".", 1)[-1] for n in (p.modules_to_save or ())]
    return 4 if p.method == "none" or "embed_tokens" in saved else a


def mlp_activation_bytes_per_token(shape: ModelShape, act_bytes: int, adapted_mlp_inputs: int) -> int:
    """The MLP's part of ``activation_bytes_per_token_layer``: gate output, silu(gate), up output and
    their product (4 a i), and PEFT's cast copies of the adapted MLP linears' inputs."""
    lora = act_bytes * adapted_mlp_inputs if act_bytes < 4 else 0
    return 4 * act_bytes * shape.mlp_width_per_token + lora


def mlp_tile_tokens(tokens: int, seq_len: int, hidden_size: int) -> int:
    """Tokens in one tile of the tiled MLP: the micro-batch's rows cut along the sequence into
    ``ceil(seq / hidden)`` tiles (``model.long_context.tile_count``, ALST's choice)."""
    tiles = max(1, -(-seq_len // hidden_size))
    return -(-tokens // tiles)


def sequence_parallel(recipe: Recipe) -> int:
    """Ranks sharing one sequence as the recipe asks (1 where it does not), for a caller without a
    resolved plan; a plan's is ``plan.layout.sp``."""
    return SEQUENCE.asked(recipe)


def tokens_per_rank(recipe: Recipe, micro: int, sp: int | None = None) -> int:
    """Tokens of one micro-batch held by one rank: each of ``sp`` ranks (the layout's; None: as the
    recipe asks) holds a slice of every sequence (the last slice may be shorter; the longest one is counted)."""
    return micro * -(-recipe.data.max_seq_len // (sp or sequence_parallel(recipe)))


def _activations(
    recipe: Recipe,
    shape: ModelShape,
    params: Params,
    tokens: int,
    a: int,
    logits: float,
    r: int | None = None,
    sp: int = 1,
) -> float:
    """Saved activations for ``tokens`` tokens on this rank, with or without gradient checkpointing.

    With checkpointing the logits are freed (the head's backward runs first) before any layer is
    recomputed, so the peak holds the larger of one recomputed layer and the logits, not both:
    only the part of the recomputed layer above the logits is counted here.
    ``model.tiled_mlp``: the MLP's own activations exist for one tile of the sequence, not all of it.
    ``model.activation_offload``: the layer inputs checkpointing keeps (the embedding output is the
    first) are in host memory; only the one being recomputed is back on the device.
    ``r``: bytes per value of the residual stream (``residual_bytes``; ``a`` when not given); ``sp``:
    ranks sharing each sequence (the tiled MLP cuts this rank's slice)."""
    m = recipe.model
    r = a if r is None else r
    seq = recipe.data.max_seq_len
    h = shape.hidden_size
    eager_seq = seq if m.attn_implementation == "eager" else 0
    whole = activation_bytes_per_token_layer(shape, a, params.adapted_inputs, eager_seq, r)
    mlp = mlp_activation_bytes_per_token(shape, a, params.adapted_mlp_inputs)
    # Tiled, a layer saves no MLP intermediates: backward recomputes them for one tile of one layer.
    tile = mlp_tile_tokens(tokens, -(-seq // sp), h) if m.tiled_mlp else 0
    saved = whole - mlp if m.tiled_mlp else whole
    per_layer = saved * tokens + mlp * tile
    # Embedding output and final norm, outside the layers.
    outside = (r + 4 + 2 * r) * h * tokens
    outside += packed_mask_bytes(recipe, tokens, sp)
    if not m.gradient_checkpointing:
        return shape.num_layers * saved * tokens + mlp * tile + outside
    layer_input = r * h * tokens
    if m.activation_offload:
        kept = layer_input  # the recomputed layer's input, brought back from the host
        outside -= layer_input  # the embedding output is layer 0's input: offloaded too
    else:
        kept = shape.num_layers * layer_input
    return kept + max(per_layer - logits, 0) + outside


MASK_NOTE_BYTES = 64 * 2**20  # sdpa's packed-row mask from which the plan suggests auto (8K-token rows)


def packed_mask_bytes(recipe: Recipe, tokens: int, sp: int | None = None) -> int:
    """The attention mask of packed rows: sdpa gets a ``rows x 1 x T x T`` boolean block-diagonal mask
    (transformers builds it once per forward, and every layer's attention keeps it for backward;
    under sequence parallelism ``llmft.model.ulysses`` builds it for the whole rows, one per layer,
    counted once: checkpointing frees the others). Flash attention, varlen_sdpa (and ``auto``,
    which picks one of them for packed rows) and flex_attention (its block mask holds
    O((T/128)^2) indices) have no seq^2 term. ``sp``: as ``tokens_per_rank``."""
    if recipe.model.attn_implementation != "sdpa" or not recipe.data.packing:
        return 0
    seq = recipe.data.max_seq_len
    rows = -(-tokens // -(-seq // (sp or sequence_parallel(recipe))))
    return rows * seq * seq


def longest_sequence(
    recipe: Recipe, engine: str, parallel: ParallelLayout | int, gpu_memory_gb: float, micro: int = 1
) -> int:
    """The longest ``data.max_seq_len`` whose run fits ``gpu_memory_gb`` GiB per GPU with
    ``micro`` sequences per micro-batch, for the recipe's sequence parallelism, offload, tiling and
    loss chunking; 0 when even one token per sequence does not fit. A multiple of 128 x
    sequence_parallel where it is that long: every rank's slice a whole number of 128-token blocks.
    ``parallel``: as ``estimate``."""
    parallel = _as_layout(recipe, engine, parallel)

    def fits(n: int) -> bool:
        probe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, max_seq_len=n))
        return estimate(probe, engine, parallel, micro, 1).fits(gpu_memory_gb)

    low, high = 0, 1
    while fits(high) and high < MAX_SEQ_SEARCH:  # doubling, then bisection: about 2 log2(n) estimates
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    step = 128 * parallel.sp
    return low // step * step if low >= step else low


# Where the search for the longest sequence stops: 2**27 tokens (134M), far past any model's context.
MAX_SEQ_SEARCH = 2**27


# --- picking the micro-batch --------------------------------------------------------------------


def pick_micro_batch(
    recipe: Recipe, engine: str, global_batch_size: int, parallel: ParallelLayout | int, gpu_memory_gb: float
) -> int:
    """The largest micro-batch that fits in ``gpu_memory_gb`` GiB and divides the local batch.

    Dividing ``global / dp_size`` keeps accumulation whole, so ``global = micro x accumulation
    x dp`` holds exactly. Raises UserError when the global batch does not split over the ranks
    or when even a micro-batch of 1 does not fit. ``parallel``: as ``estimate``.
    """
    parallel = _as_layout(recipe, engine, parallel)
    g, dp_size = global_batch_size, parallel.dp_size
    if g % dp_size:
        low = g // dp_size * dp_size
        raise UserError(
            Problem(
                "batch.global_batch_size",
                f"{g} sequences do not split evenly over {dp_size} data-parallel ranks, and llmft never rounds",
                f"Choose a global batch in {{{', '.join(str(x) for x in (low, low + dp_size) if x > 0)}}} "
                f"or a data-parallel size in {{{', '.join(map(str, divisors(g)))}}}.",
            )
        )
    local = g // dp_size
    for micro in sorted(divisors(local), reverse=True):
        if estimate(recipe, engine, parallel, micro, local // micro).fits(gpu_memory_gb):
            return micro
    one = estimate(recipe, engine, parallel, 1, local)
    raise UserError(
        Problem(
            "batch.micro_batch_size",
            f"even a micro-batch of 1 needs about {one.total / GIB:.1f} GiB per GPU, more than "
            f"{gpu_memory_gb:g} GiB ({_largest(one)})",
            "Turn on model.gradient_checkpointing, lower data.max_seq_len, use LoRA/QLoRA, shard with "
            "distributed.engine=fsdp or deepspeed zero_stage=3 on more GPUs, or offload to CPU.",
        )
    )


def host_memory_per_node(plan: RunPlan, *, device_is_host: bool = False) -> int:
    """Host RAM one node needs, in bytes: state offloaded by the engine (parameters and
    optimizer, per rank) plus the peak of loading the model, for the ranks of one node.

    Loading as llmft does it: a pretrained model on FSDP2 or ZeRO-3 is built on the meta device
    and each rank reads only its shard (``model/meta.py``, ``model/zero3.py``); a
    4-bit base too, each rank quantizing only the blocks of its part of each matrix (read in the
    compute dtype). ZeRO-3 allocates each parameter whole on the device for a moment before
    partitioning it (one at a time: the largest, the embedding or a matrix): host RAM only where
    the device is the host (``device_is_host``: a CPU run, as in bench/load_memory.py). A fresh ``model.config`` model too
    big to build whole goes through ``zero.Init`` (about one shard per rank) unless quantized:
    bitsandbytes quantizes on load, so that base is built whole on every rank, and so is every
    model on single / DDP / ZeRO 0-2. On a CPU run the frozen weights read in place
    (``_reads_in_place``) are the weight files' pages, not the ranks' memory: not counted."""
    recipe, engine = plan.recipe, plan.engine
    shape = _require_shape(recipe)
    params = count_params(recipe, shape)
    a = DTYPE_BYTES[recipe.model.dtype]
    states = _states(recipe, engine, params, a)
    layout = _layout(recipe, engine, plan.layout)
    offloaded = 0.0
    if not layout.weights_on_gpu:
        offloaded += (states["weights"] + states["adapters"]) / layout.weights + states["gradients"] / layout.gradients
    if not layout.optimizer_on_gpu:
        offloaded += (states["optimizer"] + states["master_weights"]) / layout.optimizer
    q = recipe.model.quantization
    sharded_load = plan.meta_init or (plan.zero_init and q is None)
    in_place = device_is_host and _reads_in_place(plan)
    weights = states["weights"] - (_frozen_in_file(recipe) if in_place else 0)
    loading = weights / layout.weights if sharded_load else weights
    if sharded_load:
        # This rank's part of the tensor being read (the embedding or a matrix; a 4-bit one is read
        # in the compute dtype and quantized; none where the base is read in place, bar 4-bit)...
        vocab = 0 if in_place else shape.vocab_size * shape.hidden_size
        linear = params.largest_linear if q is not None or not in_place else 0
        loading += max(vocab, linear) * a / layout.weights
        if (
            engine_spec(engine).whole_param_on_load and device_is_host
        ):  # ... and the ZeRO-3 parameter it goes into, whole for a moment
            linear_bytes = quantized_bytes_per_param(q.bits, q.double_quant) if q is not None else a
            loading += max(vocab * a, linear * linear_bytes)
    return int(plan.world.nproc_per_node * (offloaded + loading))


def step_mmap_threshold(plan: RunPlan) -> int:
    """The glibc mmap threshold for the training steps (``llmft.job.malloc.settle_for_steps``).

    Single and DDP: 32 MiB (glibc's ceiling), fixed: a step's tensors reuse the heap instead of
    faulting in fresh mappings every step. FSDP2 and ZeRO-3 gather weights every step: they keep
    the loading's 64 KiB, so a released weight leaves the resident set at once; from the heap a
    freed one in the middle of an arena stays (measured: 0.1-0.3 x B more per rank at the peak
    with the threshold at the smallest gathered matrix, more at 32 MiB; docs/benchmarks.md)."""
    return MMAP_THRESHOLD if plan.layout.shards_params else STEP_MMAP_THRESHOLD


def host_memory_per_rank(plan: RunPlan, *, device_is_host: bool = False) -> int:
    """The peak host RAM of one rank over a whole run, in bytes (``llmft plan``'s host line).

    With a GPU: its share of ``host_memory_per_node`` (loading, and what the engine offloads);
    the step's tensors are device memory. Where the device is the host (a CPU run, as in
    bench/load_memory.py) the step's tensors (``estimate_memory(plan).allocated``: this rank's
    weights or shards, the gathered ones, gradients, optimizer state, activations) are host RAM
    too, and the peak is the larger of the two phases."""
    loading = host_memory_per_node(plan, device_is_host=device_is_host) // plan.world.nproc_per_node
    if not device_is_host:
        return loading
    est = estimate_memory(plan)
    step = est.allocated
    gathers = _host_gathers(plan)
    if gathers is not None:
        # The layers' gathers and the logits are never live together (the logits exist from the
        # head's forward to its backward, between the last layer's two passes); a gathered head is.
        apart, beside = gathers
        step += int(beside + max(apart, est.logits) - est.logits - est.transient_weights)
    return max(loading, step - int(_host_mapped_weights(plan, est)))


def host_mapped_per_rank(plan: RunPlan) -> int:
    """Bytes of the pretrained weight files a CPU-only run's rank reads its frozen weights from in
    place (page cache, shared by every process reading the files; not in ``host_memory_per_rank``):
    its shards of them on FSDP2, the whole of them on ZeRO-3 (model/zero3.py keeps them whole)."""
    if not _reads_in_place(plan):
        return 0
    if engine_spec(plan.engine).param_gather == "live_window":
        return int(_frozen_in_file(plan.recipe))
    return int(_host_mapped_weights(plan, estimate_memory(plan)))


def _reads_in_place(plan: RunPlan) -> bool:
    """Whether a CPU run's FSDP2 or ZeRO-3 leaves its frozen pretrained weights in the weight
    files' pages (model/meta.py ``mapped_rows``, model/zero3.py; frozen, stored in the dtype the run
    uses, assumed here to be ``model.dtype``): an adapter run of a pretrained model whose
    parameters are not offloaded (offloaded, they are the engine's own buffers)."""
    recipe = plan.recipe
    return (
        recipe.model.config is None
        and plan.meta_init
        and engine_spec(plan.engine).shards_parameters(recipe)
        and recipe.distributed.offload_params == "none"
        and recipe.peft.method != "none"
    )


def _frozen_in_file(recipe: Recipe) -> float:
    """The frozen weights a CPU run reads in place, whole: an adapter run's whole base, a 4-bit
    base's embedding, head and norms (its linears are quantized copies)."""
    params = count_params(recipe, _require_shape(recipe))
    a = DTYPE_BYTES[recipe.model.dtype]
    if recipe.model.quantization is None:
        return params.base * a
    return (params.other + params.experts - _packed_experts(recipe, params)) * a


def _packed_experts(recipe: Recipe, params: Params, engine: str | None = None) -> int:
    """The routed expert weights a 4-bit base packs in 4 bits (``llmft.model.moe_quant``); 8 bits, or an
    engine whose record does not pack them (``EngineSpec.packs_experts``): none."""
    return params.expert_weights if packs_experts(recipe, engine) else 0


def _host_mapped_weights(plan: RunPlan, est: MemoryEstimate) -> float:
    """The part of this rank's weight shards (``est.weights``) that is the weight files' pages,
    page cache, not the rank's own memory (``_reads_in_place``)."""
    if not _reads_in_place(plan):
        return 0.0
    recipe = plan.recipe
    params = count_params(recipe, _require_shape(recipe))
    states = _states(recipe, plan.engine, params, DTYPE_BYTES[recipe.model.dtype])
    return est.weights * _frozen_in_file(recipe) / states["weights"]


def _host_fsdp_units(plan: RunPlan) -> bool:
    """A CPU run's FSDP2 with a frozen base: attention, MLP, embedding and head each a unit
    gathered alone (engines/fsdp.py). A full fine-tune's units also hold their gradients while they
    reduce: the device estimate (two layers and the root gathered) is kept for it."""
    recipe = plan.recipe
    spec = engine_spec(plan.engine)
    sharded = spec.param_gather == "per_layer" and spec.shards_parameters(recipe)
    return sharded and recipe.distributed.reshard_after_forward and recipe.peft.method != "none"


def _host_gathers(plan: RunPlan) -> tuple[float, float] | None:
    """What a CPU run's FSDP2 or ZeRO-3 step holds gathered beyond its shards, as ``(apart,
    beside)``: apart from the logits (the layers', with the whole matrices a matmul makes) and
    beside them (the head's); None where the device estimate is kept (a full fine-tune on FSDP2,
    an engine that does not shard parameters).

    FSDP2 (``_host_fsdp_units``) gathers one unit at a time: the largest (attention, MLP; the
    embedding and head only when trained or fresh: a frozen pretrained one is mapped whole from its
    file, not gathered) twice, as its all-gather's output and the unsharded copy it is copied into
    are both live while the copy runs (measured: bench/load_memory.py --phases). ZeRO-3: see
    ``host_gathered_bytes``."""
    recipe, spec = plan.recipe, engine_spec(plan.engine)
    shape = _require_shape(recipe)
    params, a = count_params(recipe, shape), DTYPE_BYTES[recipe.model.dtype]
    if _host_fsdp_units(plan):
        shapes = linear_shapes(shape)
        quant = recipe.model.quantization
        per_linear = a if quant is None else quant.bits / 8
        attention = sum(i * o for n, (i, o) in shapes.items() if n not in MLP_LINEARS) * per_linear
        mlp = sum(i * o for n, (i, o) in shapes.items() if n in MLP_LINEARS) * per_linear
        head = 2 * shape.vocab_size * shape.hidden_size * a if _vocab_gathered(recipe) else 0
        return 2 * max(attention, mlp) + _matrix_transients(recipe, params, a), head
    if spec.param_gather == "live_window" and spec.shards_parameters(recipe):
        # A CPU run's ZeRO-3 keeps about one layer gathered (plan.deepspeed.host_live_window), not
        # the GPU's 1e9 parameters that estimate_memory counts.
        layers, head = _zero3_gathered(plan)
        return layers + _matrix_transients(recipe, params, a), head
    return None


def _vocab_gathered(recipe: Recipe) -> bool:
    """Whether a CPU run gathers the embedding and head: when trained (``peft.modules_to_save``) or
    fresh (``model.config``); a frozen pretrained one is read whole from its file."""
    saved = {str(n).rsplit(".", 1)[-1] for n in recipe.peft.modules_to_save or ()}
    return recipe.model.config is not None or bool(saved & {"embed_tokens", "lm_head"})


def host_gathered_bytes(plan: RunPlan) -> int:
    """The weights a CPU run's ZeRO-3 holds gathered at its peak (``plan.deepspeed.host_live_window``:
    live window and reuse distance one decoder layer, no prefetch): two layers (the one being
    computed and the one before it while it is released; 4-bit where the base is), and the LM head, which the reuse
    distance keeps from its forward to its backward (in the compute dtype: never quantized). A
    frozen weight read in place (``_reads_in_place``) is kept whole, the file's pages: never gathered."""
    return int(sum(_zero3_gathered(plan)))


def _zero3_gathered(plan: RunPlan) -> tuple[float, float]:
    """``host_gathered_bytes`` as (the two layers, the head)."""
    recipe = plan.recipe
    shape = _require_shape(recipe)
    params, a = count_params(recipe, shape), DTYPE_BYTES[recipe.model.dtype]
    q = recipe.model.quantization
    in_place = _reads_in_place(plan)
    linear_bytes = quantized_bytes_per_param(q.bits, q.double_quant) if q is not None else 0 if in_place else a
    norms = 0 if in_place else (params.layer - shape.layer_linear_params) * a
    layer = shape.layer_linear_params * linear_bytes + norms
    gathered_head = not in_place or _vocab_gathered(recipe)
    return 2 * layer, shape.vocab_size * shape.hidden_size * a if gathered_head else 0


def _live_window(params: Params, gather: float) -> float:
    return min(params.base, ZERO3_MAX_LIVE_PARAMETERS) * gather


# What may make a recipe fit, tried in this order: (recipe key, value, what it costs).
FIT_OPTIONS: tuple[tuple[str, object, str], ...] = (
    ("model.chunked_loss", True, "nothing"),
    ("model.gradient_checkpointing", True, "~1/3 more compute"),
    ("distributed.fsdp_grad_sync", "micro_step", "a reduce-scatter per micro-step"),
    ("distributed.offload_params", "cpu", "host RAM and PCIe traffic"),
    ("distributed.offload_optimizer", "cpu", "host RAM, the optimizer step on the CPU"),
)


def check_fits(plan: RunPlan) -> None:
    """Before anything is loaded: with ``distributed.gpu_memory_gb`` set, a run the planner says
    cannot fit is a UserError with the numbers and the settings that would make it fit."""
    gpu_gb = plan.recipe.distributed.gpu_memory_gb
    if gpu_gb is None or model_shape(plan.recipe.model) is None:
        return
    est = estimate_memory(plan)
    if est.fits(gpu_gb):
        return
    options = fit_options(plan, gpu_gb)
    raise UserError(
        Problem(
            "distributed.gpu_memory_gb",
            f"the planner estimates {est.total / GIB:.1f} GiB per GPU for this run, more than {gpu_gb:g} GiB "
            f"(largest: {_largest(est)}; `llmft plan` shows every component)",
            ("Settings that fit: " + "; ".join(options) + "." if options else "No single setting makes it fit: ")
            + " Or lower batch.micro_batch_size / data.max_seq_len, use LoRA/QLoRA, or shard over more GPUs.",
        )
    )


def fit_options(plan: RunPlan, gpu_gb: float) -> list[str]:
    """Each option of ``FIT_OPTIONS`` (cumulated in order) the engine accepts, with its estimate,
    and the largest micro-batch that fits; only those that fit."""
    import copy

    out, recipe = [], copy.deepcopy(plan.recipe)
    micro, acc = plan.batch.micro_batch_size, plan.batch.gradient_accumulation_steps
    for key, value, cost in FIT_OPTIONS:
        section, name = key.split(".")
        if getattr(getattr(recipe, section), name) == value or not _applies(key, plan):
            continue
        setattr(getattr(recipe, section), name, value)
        est = estimate(recipe, plan.engine, plan.layout, micro, acc)
        if est.fits(gpu_gb):
            out.append(f"{key}={str(value).lower()} ({est.total / GIB:.1f} GiB; costs {cost})")
    local = micro * acc
    for smaller in sorted((d for d in divisors(local) if d < micro), reverse=True):
        est = estimate(plan.recipe, plan.engine, plan.layout, smaller, local // smaller)
        if est.fits(gpu_gb):
            out.append(f"batch.micro_batch_size={smaller} ({est.total / GIB:.1f} GiB)")
            break
    return out


def _applies(key: str, plan: RunPlan) -> bool:
    spec = plan.spec
    sharding = spec.sharding_for(plan.zero_stage)
    if key == "distributed.fsdp_grad_sync":
        return spec.honours(key) and plan.batch.gradient_accumulation_steps > 1
    if key == "distributed.offload_params":
        return bool(spec.param_offload) and sharding.params
    if key == "distributed.offload_optimizer":
        return bool(spec.optimizer_offload) and sharding.optimizer
    return True


def _largest(est: MemoryEstimate) -> str:
    top = sorted(est.components(), key=lambda c: -c[1])[:3]
    return ", ".join(f"{name} {b / GIB:.1f}" for name, b in top)


# --- llmft plan ---------------------------------------------------------------------------------


def format_estimate(est: MemoryEstimate) -> str:
    always = ("reference",) if est.rows_per_item > 1 else ()
    shown = [(n, b) for n, b in est.components() if n not in est.OPTIONAL or n in always or b > 0]
    rows = [(name.replace("_", " "), b) for name, b in shown]
    width = max(len(n) for n, _ in rows) + 2
    lines = [f"{'component':<{width}}{'GiB':>8}"]
    lines += [f"{n:<{width}}{b / GIB:>8.2f}" for n, b in rows]
    lines.append(f"{'total':<{width}}{est.total / GIB:>8.2f}")
    lines.append(
        f"{'tensors':<{width}}{est.allocated / GIB:>8.2f}  (total - overhead: torch.cuda.max_memory_allocated)"
    )
    return "\n".join(lines)

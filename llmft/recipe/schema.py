"""The recipe schema: every key a recipe may hold, its type, default and meaning.

Each field carries its documentation in ``metadata["doc"]``; ``llmft compile
--help``-style references and docs/recipe.md are generated from it, so the
text here is the single source of truth for what a key means.

Keys whose value may be a number or the word ``auto`` are typed ``Any`` (OmegaConf
has no unions); ``recipe.validate`` checks them.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional


def doc(default: Any, text: str, *, choices: tuple | None = None, allow_nonfinite: bool = False) -> Any:
    """A dataclass field with documentation (and, optionally, allowed values).

    Every float in a recipe must be finite and every int fit 64 bits (``recipe.validate``);
    ``allow_nonfinite`` exempts a key whose meaning has a use for inf or nan (none does yet)."""
    meta: dict[str, Any] = {"doc": text}
    if choices is not None:
        meta["choices"] = choices
    if allow_nonfinite:
        meta["allow_nonfinite"] = True
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    if is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class RunConfig:
    output_dir: str = doc("runs/default", "Directory for metrics, checkpoints and the resolved recipe.")
    seed: int = doc(0, "Seed for model init, data order, dropout and everything else random (0 to 2**32 - 1).")
    name: Optional[str] = doc(None, "A label for the run (shown in logs); defaults to the output dir name.")
    overwrite: bool = doc(
        False,
        "Allow a fresh run (checkpoint.resume=never) to delete an earlier run's checkpoints and metrics in "
        "output_dir, and a run to take over an output_dir of other files that is not an llmft run; llmft's own "
        "names only are removed or replaced, every other file is kept.",
    )
    trackers: List[str] = doc(
        ["tensorboard"],
        "Where metrics go besides metrics.jsonl: any of tensorboard, wandb, mlflow (extras "
        '`pip install -e ".[wandb,mlflow]"`); configured by WANDB_* / MLFLOW_* environment variables. '
        "See docs/tracking.md.",
    )
    tensorboard: bool = doc(True, "false drops tensorboard from run.trackers (the older switch, still honoured).")
    project: Optional[str] = doc(
        None,
        "W&B project and MLflow experiment; null: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else 'llmft'.",
    )
    mlflow_tracking_uri: Optional[str] = doc(
        None, "MLflow tracking URI (server URL, sqlite:///mlflow.db, file:./mlruns); null: MLFLOW_TRACKING_URI."
    )


@dataclass
class QuantizationConfig:
    bits: int = doc(4, "4 (NF4 with double quantization: QLoRA) or 8 (LLM.int8) via bitsandbytes.", choices=(4, 8))
    quant_type: str = doc("nf4", "4-bit data type.", choices=("nf4", "fp4"))
    double_quant: bool = doc(True, "Quantize the 4-bit quantization constants too (saves ~0.4 bit/param).")
    quant_storage: Optional[str] = doc(
        None,
        "Storage dtype of packed 4-bit weights. FSDP and ZeRO-3 need it equal to model.dtype; null picks that "
        "automatically when sharding (and uint8 otherwise).",
        choices=(None, *DTYPES, "uint8"),
    )


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = doc(None, "Hugging Face hub id or local directory of the model to fine-tune.")
    config: Optional[Dict[str, Any]] = doc(
        None,
        "Instead of name_or_path: HF config fields (with model_type) to build a fresh randomly "
        "initialised model. null switches it off.",
    )
    tokenizer: Optional[str] = doc(
        None,
        "Tokenizer dir or hub id. Default: the model's own; with model.config, a built-in "
        "byte-level tokenizer (vocab 320 suffices).",
    )
    dtype: str = doc("bf16", "Training (compute) dtype.", choices=DTYPES)
    attn_implementation: str = doc(
        "sdpa",
        "Attention kernel passed to transformers. varlen_sdpa: torch's sdpa run causally on each example of a "
        "packed row (no seq^2 mask; memory linear in the row's length, any device). auto: flash_attention_2 "
        "where flash-attn imports and CUDA is present, else varlen_sdpa with data.packing, else sdpa. "
        "flex_attention needs CUDA to train (torch has no FlexAttention backward on CPU). docs/long-context.md.",
        choices=("sdpa", "eager", "flash_attention_2", "flex_attention", "varlen_sdpa", "auto"),
    )
    gradient_checkpointing: bool = doc(False, "Recompute activations in the backward pass to save memory.")
    activation_offload: bool = doc(
        False,
        "Keep the checkpointed activations (each decoder layer's input, saved by gradient checkpointing) in "
        "host memory (torch's save_on_cpu, pinned on CUDA) and bring them back one layer at a time in backward: "
        "device memory for long sequences, for host RAM and PCIe traffic. Requires model.gradient_checkpointing.",
    )
    tiled_mlp: bool = doc(
        False,
        "Compute each decoder layer's MLP in sequence tiles of about hidden_size tokens: its tokens x "
        "intermediate_size activations exist for one tile at a time; backward recomputes the MLP once more. "
        "Same gradients. single and deepspeed use DeepSpeed's TiledMLP (from ALST; needs peft.dropout 0 on "
        "the MLP, its recomputed tiles do not replay dropout's random state); ddp and fsdp one checkpoint per tile.",
    )
    chunked_loss: Any = doc(
        "auto",
        "true / false: compute the LM head and the cross-entropy in chunks of tokens, so the fp32 logits of "
        "the whole micro-batch never exist at once (same loss and gradients). auto: on when a micro-batch "
        "has more tokens than one chunk (2**24 / vocab_size tokens).",
        choices=(True, False, "auto"),
    )
    quantization: Optional[QuantizationConfig] = doc(
        None, "null, or {bits: 4} / {bits: 8}: load the frozen base weights quantized with bitsandbytes."
    )
    trust_remote_code: bool = doc(False, "Run model code shipped with a hub repo. Off unless you turn it on.")
    revision: Optional[str] = doc(None, "Hub revision (branch, tag or commit) of name_or_path.")
    compile: bool = doc(
        False,
        "torch.compile each decoder layer (regional compilation, before FSDP2 shards it); same losses as eager "
        "to float tolerance. Needs a C++ compiler on CPU, Triton on CUDA; not with distributed.engine=deepspeed.",
    )
    liger_kernels: bool = doc(
        False,
        "Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) on CUDA; needs "
        "pip install -e '.[liger]' and a model type Liger supports (llama, mistral, qwen2, ...). An error on CPU.",
    )
    hub_kernels: bool = doc(
        False,
        "Let transformers replace layers (RMSNorm, rotary, MLP, ...) with compiled kernels it downloads from "
        "the Hugging Face Hub (kernels-community/*, via the `kernels` package) and runs, when it loads "
        "pretrained weights on a GPU. Needs the Hub (or those kernels in the HF cache) and the `kernels` "
        "package. Off: no code is fetched from the Hub; transformers' own torch layers run (docs/offline.md).",
    )


@dataclass
class PeftConfig:
    method: str = doc("none", "none (full fine-tune), lora, or dora.", choices=("none", "lora", "dora"))
    r: int = doc(16, "LoRA rank.")
    alpha: float = doc(32.0, "LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = doc(0.0, "Dropout on the LoRA input.")
    target_modules: Any = doc(
        "all-linear", "Module names to adapt: a list of names, or 'all-linear' (every linear layer but the head)."
    )
    modules_to_save: Optional[List[str]] = doc(None, "Extra modules trained fully and saved with the adapter.")
    target_experts: Optional[bool] = doc(
        None,
        "LoRA on the fused expert weights of a mixture-of-experts model (docs/moe.md); null: on for an MoE "
        "model under lora, off under dora.",
    )
    train_router: bool = doc(False, "Train an MoE model's router in full (saved with the adapter); false: frozen.")


@dataclass
class MoEConfig:
    aux_loss_coef: Optional[float] = doc(
        None,
        "Weight of the router's load-balancing loss (mixture-of-experts models only); null: the model "
        "config's router_aux_loss_coef; 0: off.",
    )
    balance: str = doc(
        "global_batch",
        "global_batch: the family's balancing loss over the whole global batch, the same for any split and "
        "any number of ranks (a routing pre-pass per step, docs/moe.md); micro_batch: over each micro-batch "
        "(transformers Trainer's), averaged.",
        choices=("global_batch", "micro_batch"),
    )
    z_loss_coef: Optional[float] = doc(
        None, "Weight of the router z-loss, for a family that defines one; null: the family's."
    )


@dataclass
class DataConfig:
    train: Any = doc(
        None,
        "Training data: a JSONL/JSON/Parquet/CSV file, a directory of them, a glob, a datasets save_to_disk "
        "dir or a hub dataset id; or a list of sources, each such a path or a mapping {path, weight, split, "
        "name, revision, train_on, fields} (weight: times per epoch, e.g. 2 or 0.5). See docs/data.md.",
    )
    eval: Any = doc(
        None, "Held-out data in the same forms (no weights); null disables eval (unless eval_fraction > 0)."
    )
    eval_fraction: float = doc(0.0, "Hold out this fraction of each data.train source for eval when data.eval is null.")
    max_seq_len: Any = doc(
        2048,
        "Tokens per sequence; longer records are truncated (and counted). auto (with distributed.gpu_memory_gb): "
        "the longest sequence the planner fits per GPU for the recipe's sequence parallelism, activation offload, "
        "tiling and chunked loss, at batch.micro_batch_size (1 where that is auto); llmft plan prints it.",
    )
    packing: bool = doc(False, "Concatenate records into max_seq_len rows; attention never crosses record boundaries.")
    shuffle: bool = doc(True, "Reshuffle the records every epoch with a seeded permutation.")
    train_on: str = doc(
        "completion",
        "Which tokens are targets: 'completion' (completion / assistant turns only; plain text records "
        "train on all), or 'all'. A source may override it.",
        choices=("completion", "all"),
    )
    on_bad_record: str = doc(
        "error", "A malformed record: 'error' (stop, naming file:line) or 'skip' (count it).", choices=("error", "skip")
    )
    chat_template: Optional[str] = doc(
        None,
        "Chat template for messages records: a Jinja file, or a built-in name (llmft, chatml, llama3); "
        "null: the tokenizer's own. It is saved with the tokenizer in checkpoints.",
    )
    cache_dir: Optional[str] = doc(
        None,
        "Where tokenized data is cached (shared by runs and ranks); null: $LLMFT_CACHE/data, else "
        "~/.cache/llmft/data. `llmft prepare` fills it ahead of training.",
    )
    num_proc: Optional[int] = doc(None, "Processes that tokenize when the cache is built; null: the CPU cores.")
    streaming: bool = doc(
        False,
        "Read, tokenize and pack data.train on the fly instead of caching it (data too large to cache); "
        "needs train.max_steps. See docs/data.md.",
    )
    stream_block: int = doc(
        1000,
        "With data.streaming: records read, tokenized, packed and shuffled together; a resume re-reads at "
        "most one block.",
    )
    mixture: str = doc(
        "repeat",
        "What a data.train source's weight means: 'repeat' (times per epoch, e.g. 2 or 0.5) or 'probability' "
        "(weights / their sum is each source's exact share of every window of 10,000 samples).",
        choices=("repeat", "probability"),
    )
    num_workers: int = doc(1, "DataLoader worker processes (0 loads in the training process).")
    prefetch_factor: int = doc(4, "Micro-batches each worker prepares ahead.")


@dataclass
class BatchConfig:
    global_batch_size: Any = doc("auto", "Sequences per optimizer step across all data-parallel ranks (int or auto).")
    micro_batch_size: Any = doc("auto", "Sequences per device per forward/backward (int or auto).")
    gradient_accumulation_steps: Any = doc("auto", "Micro-batches per optimizer step on each rank (int or auto).")
    global_batch_tokens: Optional[int] = doc(
        None,
        "With data.packing: tokens per optimizer step; sets global_batch_size = global_batch_tokens / max_seq_len.",
    )


@dataclass
class OptimConfig:
    name: str = doc(
        "adamw",
        "adamw, sgd (torch), adamw_8bit, paged_adamw, paged_adamw_8bit (bitsandbytes).",
        choices=("adamw", "sgd", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"),
    )
    lr: float = doc(2e-4, "Peak learning rate.")
    weight_decay: float = doc(0.0, "Decoupled weight decay (not applied to biases and norms).")
    betas: List[float] = doc([0.9, 0.999], "Adam betas.")
    eps: float = doc(1e-8, "Adam epsilon.")
    momentum: float = doc(0.0, "SGD momentum.")
    scheduler: str = doc("cosine", "LR schedule after warmup.", choices=("constant", "linear", "cosine"))
    warmup_steps: int = doc(0, "Optimizer steps of linear warmup from 0 to lr.")
    min_lr_ratio: float = doc(0.0, "Final lr as a fraction of lr for linear and cosine.")
    max_grad_norm: Optional[float] = doc(1.0, "Clip the global gradient norm at each optimizer step; null: off.")
    lr_scaling: str = doc(
        "none",
        "Scale lr with the global batch: none, linear (lr * G / base) or sqrt (lr * sqrt(G / base)).",
        choices=("none", "linear", "sqrt"),
    )
    lr_scaling_base_batch: int = doc(1, "The global batch size at which optim.lr was tuned (the base of lr_scaling).")


@dataclass
class TrainConfig:
    max_steps: Optional[int] = doc(None, "Optimizer steps to train (not micro-steps). Or set epochs.")
    epochs: Optional[float] = doc(
        None, "Passes over data.train, converted to whole optimizer steps (rounded up); ignored when max_steps is set."
    )
    log_every_steps: int = doc(1, "Write a metrics.jsonl row every N optimizer steps.")
    eval_every_steps: Optional[int] = doc(
        None, "Evaluate every N optimizer steps (and at the end); null: only at the end."
    )
    eval_max_batches: Optional[int] = doc(None, "Cap the number of eval micro-batches; null: the whole eval set.")
    eval_generate_samples: int = doc(
        0,
        "Greedy-generate completions for this many eval prompt/completion records and log exact-match "
        "accuracy (0: off).",
    )
    eval_max_new_tokens: int = doc(32, "Longest generated completion for the exact-match eval.")
    eval_generate_backend: str = doc(
        "hf",
        "The exact-match eval's generation: hf (transformers generate() on the model as the engine holds it) or "
        "vllm (a vLLM engine with rollout.vllm's settings, colocated or a rollout server, given the trainer's "
        "weights before each eval; docs/rl.md).",
        choices=("hf", "vllm"),
    )
    progress_bar: bool = doc(True, "Show a progress bar on rank 0.")
    objective: str = doc(
        "sft",
        "What the model learns, a name in the objective registry (llmft.plan.objectives): sft (next-token loss "
        "on the targets), dpo (preference pairs; see preference.*), reward (a scalar reward model trained on "
        "preference pairs), grpo (online RL from rewards: see rollout.*, rl.*, rewards), or one that "
        "train.objective_module registers.",
    )
    objective_module: Optional[str] = doc(
        None,
        "A Python module (dotted name, importable on every rank: installed or on PYTHONPATH) that registers "
        "train.objective with llmft.plan.objectives.register_objective, and any recipe section of its own "
        "(llmft.recipe.sections.register_section); imported when the recipe is loaded. It is code you name, "
        'run like a reward function\'s module:name (docs/design.md, "Adding an objective"); null: the built-in '
        "objectives only.",
    )


@dataclass
class PreferenceConfig:
    loss_type: str = doc(
        "sigmoid",
        "Preference loss (train.objective=dpo): sigmoid (DPO), ipo, hinge, simpo or orpo (the last two reference-free).",
        choices=("sigmoid", "ipo", "hinge", "simpo", "orpo"),
    )
    beta: float = doc(0.1, "Strength of the preference term (the DPO / IPO / SimPO / ORPO beta).")
    label_smoothing: float = doc(0.0, "Conservative DPO: the assumed fraction of flipped labels (sigmoid only).")
    simpo_gamma: float = doc(0.5, "SimPO's target reward margin (loss_type=simpo).")
    reference: str = doc(
        "auto",
        "The reference model: auto (LoRA/QLoRA: the same model with adapters disabled; full fine-tune: a frozen "
        "copy of the initial weights), or a model path / hub id.",
    )
    precompute_reference: bool = doc(
        False,
        "Compute the reference log-probs once, store them with the token cache entry, and train without a "
        "reference model.",
    )


@dataclass
class VLLMConfig:
    mode: str = doc(
        "colocate",
        "colocate: a vLLM engine in every training process, sharing its devices (its memory released while the "
        "model updates on a GPU, vLLM's sleep mode); server: the engine of `llmft rollout-server RECIPE` at "
        "rollout.vllm.url, started separately. Either way the trainer's weights are synced into it before every "
        "generation.",
        choices=("colocate", "server"),
    )
    url: Optional[str] = doc(
        None, "mode=server: the rollout server's address, e.g. http://node7:8000 (llmft rollout-server's --port)."
    )
    gpu_memory_utilization: float = doc(
        0.3,
        "The share of the device's memory the colocated engine takes for weights and KV cache (on a CPU: of host "
        "memory, vLLM's CPU backend).",
    )
    kv_cache_gib: Optional[float] = doc(
        None, "The engine's KV cache in GiB (vLLM's kv_cache_memory_bytes); null: from gpu_memory_utilization."
    )
    tensor_parallel_size: int = doc(
        1,
        "Devices one vLLM engine spans. colocate: that many consecutive training ranks share one engine "
        "(it divides the world); server: llmft rollout-server runs that many processes (docs/rl.md).",
    )
    max_model_len: Optional[int] = doc(None, "The engine's longest sequence; null: data.max_seq_len.")
    batch_invariant: bool = doc(
        False,
        "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT: a completion's numbers do not depend on what shares its "
        "batch); GPU only (its kernels are Triton's).",
    )


@dataclass
class RolloutConfig:
    num_generations: int = doc(
        8,
        "G: completions generated per prompt (train.objective=grpo). The global batch counts completions: "
        "prompts per step x G = micro x accumulation x data-parallel.",
    )
    max_new_tokens: int = doc(
        128, "Longest completion; a prompt may use data.max_seq_len minus this (longer prompts are refused)."
    )
    temperature: float = doc(1.0, "Sampling temperature of generation (0 < t).")
    top_p: float = doc(1.0, "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.")
    backend: str = doc(
        "hf",
        "hf: transformers generate() with a KV cache, on every engine; vllm: a vLLM engine (rollout.vllm, "
        "docs/rl.md); file: completions read from rollout.file.",
        choices=("hf", "vllm", "file"),
    )
    file: Optional[str] = doc(
        None,
        'rollout.backend=file: a JSONL of {"prompt": <the record\'s prompt, as in the data>, "completions": [G strings]}, '
        'looked up by prompt; or "completion_ids": [G lists of token ids], trained as given (rollout.save_completions).',
    )
    batch_size: Optional[int] = doc(
        None, "Completions generated together by one generate() call on a rank; null: all of a step's on that rank."
    )
    vllm: VLLMConfig = doc(VLLMConfig(), "rollout.backend=vllm: the vLLM engine (docs/rl.md).")
    save_completions: bool = doc(
        False,
        "Append every generated completion to <output_dir>/completions/rank-<r>.jsonl: generation batch, position, "
        "prompt, text, token ids (and the sampler's log-probs with rl.importance_correction=tis); a rollout.file "
        "made of those lines (completion_ids) trains on the same tokens.",
    )
    tools: List[str] = doc(
        [],
        'Tools the policy may call in multi-turn episodes (TRL\'s tools): "module:function" each, a plain function '
        "whose name, type hints and docstring (Google style, with Args:) make the schema the chat template gets; "
        "its result goes back to the model as a tool message (docs/rl.md).",
    )
    environment: Any = doc(
        None,
        'A class (TRL\'s environment_factory contract: "module:Class") made once per episode slot and reset per '
        "episode with the record's fields (reset(**record) returns None or text appended to the last user "
        "message); its public methods are tools; its optional get_reward() is a reward column named after the "
        'class. Or {name: "module:Class", ...}: each record\'s environment field picks one.',
    )
    max_turns: int = doc(8, "Multi-turn episodes: the policy's turns (assistant messages) per episode, at most.")
    max_tool_calls: Optional[int] = doc(
        None, "Multi-turn episodes: tool calls per episode, at most (the episode ends there); null: no bound."
    )
    tool_timeout_s: Optional[float] = doc(
        60.0,
        "Multi-turn episodes: seconds a tool call may take (it runs in a thread of its own); a later call is a "
        "tool failure and ends its episode. null: calls run in the training thread, without a deadline.",
    )
    async_: int = doc(
        0,
        "rollout.backend=vllm: 1 generates the completions of step k+1 while step k "
        "updates, from the weights before step k (exactly one step stale, corrected by rl.importance_correction=tis); "
        "0: each step's completions from its own weights.",
        choices=(0, 1),
    )


def keyword_key(cls: type, name: str, key: str) -> type:
    """Give the dataclass field ``name`` the recipe key ``key``, a Python keyword (``rollout.async``):
    OmegaConf and the schema's readers see ``key``; code reads it with ``getattr(section, key)``."""
    f = cls.__dataclass_fields__.pop(name)  # type: ignore[attr-defined]
    f.name = key
    cls.__dataclass_fields__[key] = f  # type: ignore[attr-defined]
    cls.__annotations__ = {(key if k == name else k): v for k, v in cls.__annotations__.items()}
    if f.default is not MISSING:
        setattr(cls, key, f.default)
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if key in kwargs:
            kwargs[name] = kwargs.pop(key)
        init(self, *args, **kwargs)
        setattr(self, key, getattr(self, name))

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


keyword_key(RolloutConfig, "async_", "async")


@dataclass
class RLConfig:
    beta: float = doc(0.0, "KL to the reference model per token (k3 estimator); 0: no reference model is built or run.")
    epsilon: float = doc(0.2, "Lower clipping bound of the ratio: 1 - epsilon.")
    epsilon_high: Optional[float] = doc(
        None, "Upper clipping bound of the ratio: 1 + epsilon_high (DAPO's clip-higher); null: epsilon."
    )
    iterations: int = doc(
        1, "Policy updates per generation batch (TRL num_iterations, the PPO epochs); old log-probs kept when > 1."
    )
    scale_rewards: str = doc(
        "group",
        "Advantage = reward - group mean, divided by: group (the group's std), batch (the global batch's std), "
        "or none (Dr. GRPO).",
        choices=("group", "batch", "none"),
    )
    normalise: str = doc(
        "global_token",
        "The loss normaliser: global_token (every completion token of the global batch; TRL's dapo), sequence "
        "(each completion's token mean, then the mean over completions; TRL's grpo), or constant "
        "(completions x rollout.max_new_tokens; TRL's dr_grpo).",
        choices=("global_token", "sequence", "constant"),
    )
    importance_correction: Optional[str] = doc(
        None,
        "Correct the policy loss for the sampler's log-probs differing from the trainer's: tis (truncated "
        "importance sampling: each completion token's policy term times min(exp(trainer's old log-prob - "
        "sampler's log-prob), rl.is_cap); TRL's vllm_importance_sampling_mode token_truncate) or none. null: "
        "tis with rollout.backend vllm, none otherwise. With tis the mismatch is logged every step (mismatch/*).",
        choices=(None, "none", "tis"),
    )
    is_cap: float = doc(3.0, "rl.importance_correction=tis: the cap of each token's importance weight (> 0).")
    reward_workers: int = doc(
        2,
        "Worker processes per reward function or builtin (each call with a deadline, rewards[].timeout_s, in a "
        "bubblewrap sandbox where it works: docs/rl.md); 0: in the training process, one call at a time, "
        "unbounded.",
    )


@dataclass
class CheckpointConfig:
    every_steps: Optional[int] = doc(None, "Checkpoint every N optimizer steps (and always at the end).")
    keep_last: Optional[int] = doc(3, "Keep the newest N checkpoints; null keeps all.")
    resume: str = doc("auto", "auto (newest complete checkpoint in output_dir, if any), never, or a checkpoint path.")
    save_optimizer: bool = doc(True, "Save optimizer state (needed for an exact resume).")


@dataclass
class DistributedConfig:
    engine: str = doc(
        "auto",
        "auto, single, ddp, fsdp or deepspeed. auto: single for one process; on several, deepspeed "
        "when optimizer state is offloaded or params to nvme, fsdp for a full fine-tune or params "
        "offloaded to cpu, ddp for adapters.",
        choices=("auto", "single", "ddp", "fsdp", "deepspeed"),
    )
    zero_stage: int = doc(2, "DeepSpeed ZeRO stage 0-3.", choices=(0, 1, 2, 3))
    offload_optimizer: str = doc(
        "none", "Optimizer state offload: none, cpu, or nvme (DeepSpeed).", choices=("none", "cpu", "nvme")
    )
    offload_params: str = doc(
        "none",
        "Parameter offload: none, cpu (DeepSpeed ZeRO-3 or FSDP), or nvme (DeepSpeed).",
        choices=("none", "cpu", "nvme"),
    )
    nvme_path: str = doc("/local_nvme", "Directory for nvme offload.")
    reshard_after_forward: bool = doc(
        True, "FSDP2: free gathered params after forward (ZeRO-3 like); false keeps them (ZeRO-2 like)."
    )
    hsdp_replicate: int = doc(
        1, "FSDP2 HSDP: number of replica groups; params are sharded within a group of dp_size / hsdp_replicate."
    )
    fsdp_grad_sync: str = doc(
        "boundary",
        "FSDP2 with accumulation: boundary (one reduce-scatter per optimizer step; every micro-step's "
        "gradients stay unsharded in fp32 until then) or micro_step (a reduce-scatter per micro-step; "
        "gradients stay sharded: less memory, accumulation x the gradient communication).",
        choices=("boundary", "micro_step"),
    )
    reduce_dtype: str = doc("fp32", "dtype of gradient reduction under FSDP mixed precision.", choices=DTYPES)
    sequence_parallel: int = doc(
        1,
        "Sequence parallelism (Ulysses): N ranks share each sequence, each holding 1/N of its tokens; "
        "attention exchanges heads all-to-all within the group. Data-parallel size = world / N, so "
        "global = micro x accumulation x (world / N). N must divide the world and the attention heads "
        "(docs/long-context.md). ddp, fsdp or deepspeed.",
    )
    expert_parallel: int = doc(
        1,
        "Expert parallelism (FSDP2, mixture-of-experts models): N ranks of the shard dimension split every MoE "
        "layer's routed experts, E / N whole experts each, and exchange tokens all-to-all. Borrowed from the "
        "data-parallel ranks: world, data-parallel size and global batch are unchanged. N must divide the "
        "shard dimension and the experts (docs/moe.md).",
    )
    nnodes: int = doc(1, "Nodes the job runs on (used by compile and the launch scripts).")
    nproc_per_node: int = doc(1, "Processes (GPUs) per node.")
    master_port: int = doc(29500, "Rendezvous port on the first node.")
    backend: str = doc(
        "auto",
        "Process-group backend: auto (nccl with CUDA, else gloo), nccl or gloo.",
        choices=("auto", "nccl", "gloo"),
    )
    stop_signal: str = doc(
        "SIGUSR1",
        "Signal that asks for checkpoint-and-exit besides SIGTERM and SIGINT (SLURM's --signal).",
        choices=("SIGUSR1", "SIGUSR2"),
    )
    gpu_memory_gb: Optional[float] = doc(
        None, "Memory per GPU for the planner (batch.micro_batch_size=auto); null: the detected device."
    )
    timeout_s: int = doc(
        600,
        "The longest, in seconds, any collective or training step may wait (multi-rank runs): a "
        "collective that waits longer fails, and a rank whose training loop makes no progress that long "
        "(eval and checkpoint saves excepted: their collectives are timed) logs the step, the phase and "
        "collective it was in and a Python stack of every thread, and exits 124; the launcher ends the "
        "other ranks (docs/reliability.md). Keep it a few minutes above the slowest step and the slowest "
        "checkpoint write.",
    )
    timeout_minutes: Optional[int] = doc(
        None, "Older spelling of distributed.timeout_s in minutes; when set it wins (recipes written before timeout_s)."
    )


@dataclass
class Recipe:
    run: RunConfig = doc(RunConfig(), "Output and seeding.")
    model: ModelConfig = doc(ModelConfig(), "What to fine-tune.")
    peft: PeftConfig = doc(PeftConfig(), "Parameter-efficient fine-tuning.")
    data: DataConfig = doc(DataConfig(), "Training and eval data.")
    batch: BatchConfig = doc(BatchConfig(), "The batch equation: global = micro x accumulation x dp.")
    optim: OptimConfig = doc(OptimConfig(), "Optimizer and schedule.")
    train: TrainConfig = doc(TrainConfig(), "Length, logging and eval cadence.")
    checkpoint: CheckpointConfig = doc(CheckpointConfig(), "Checkpoints and resume.")
    preference: PreferenceConfig = doc(PreferenceConfig(), "Preference tuning (train.objective: dpo or reward).")
    rollout: RolloutConfig = doc(RolloutConfig(), "Generation for online RL (train.objective: grpo).")
    rl: RLConfig = doc(RLConfig(), "The online RL loss (train.objective: grpo).")
    rewards: List[Any] = doc(
        [],
        'Rewards of train.objective=grpo: a list of {function: "module:name", weight} (a Python function of '
        "prompt, completion and the record's other fields, returning a float or None), {builtin: math_verify | "
        "code_tests, weight} and/or {model: DIR, weight} (a reward model, e.g. one exported by "
        "train.objective=reward). A function or builtin also takes timeout_s (a call's deadline, default 60), "
        "on_timeout (none: a late call is no opinion, counted in reward_timeouts/<name>; error: the run stops) "
        "and sandbox (bwrap or none); docs/rl.md.",
    )
    distributed: DistributedConfig = doc(DistributedConfig(), "Engine and world layout.")
    moe: MoEConfig = doc(MoEConfig(), "Mixture-of-experts routing (docs/moe.md).")


def iter_fields(cls: type = Recipe, prefix: str = ""):
    """Yield (dotted_key, dataclass_field, nested_dataclass_or_None) for the schema, depth first."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        sub = next((c for c in (tp, *getattr(tp, "__args__", ())) if isinstance(c, type) and is_dataclass(c)), None)
        yield key, f, sub
        if sub is not None:
            yield from iter_fields(sub, key + ".")


def default_of(f) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return MISSING

"""TRL's ``GRPOTrainer`` as an outside reference for llmft's GRPO: completions injected, no sampling.

``trl_grpo_run`` trains a model dir with TRL's ``GRPOTrainer`` (trl 1.16.0, the version pinned in
the dev extra, pyproject.toml) on CPU in fp32, with the completions of every prompt taken from a
dict instead of sampled, and returns the trainable weights before and after ``steps`` optimizer
steps (plus what TRL tokenized, scored and trained on). ``reference_grpo_step`` is the same step in
a few lines of plain torch: the readable statement of what TRL computes
(tests/unit/test_trl_grpo_peer.py checks the two against each other). Neither imports llmft's GRPO.

File:line references are to trl 1.16.0's trl/trainer/ (grpo_trainer.py, grpo_config.py, utils.py)
unless they name another folder.

Batch
-----
- ``per_device_train_batch_size`` counts completions, not prompts. ``steps_per_generation`` defaults
  to ``gradient_accumulation_steps`` and ``generation_batch_size`` to per_device x processes x
  steps_per_generation (grpo_config.py:1098-1100): one generation batch per optimizer step, of
  ``generation_batch_size / num_generations`` prompts x G completions.
- Prompt order (``shuffle_dataset=False``, grpo_config.py:507): ``RepeatSampler`` (utils.py:859,
  built at grpo_trainer.py:1309-1316) walks the dataset in order in chunks of
  ``generation_batch_size / G`` prompts (an incomplete last chunk is dropped), each index repeated G
  times in a row (prompt-major: p0 x G, p1 x G, ...), each chunk ``num_iterations x
  steps_per_generation`` times: every micro-step's dataloader batch is a whole generation batch
  (grpo_trainer.py:1275), generated for only every ``steps_per_generation x num_iterations``
  micro-steps and buffered in between (grpo_trainer.py:1538-1546). With num_iterations=1, optimizer
  step s (0-based) takes chunk s; past the end of the dataset the next epoch starts again from the
  first prompt. With num_iterations=k, k optimizer steps in a row reuse one generation batch.
- The generation batch is permuted at random (``shuffle_sequence_dict``, global torch RNG,
  grpo_trainer.py:1543, utils.py:1092) and then cut into ``steps_per_generation`` equal
  micro-batches (grpo_trainer.py:1544, utils.py:1057). Which completions share a micro-batch is
  therefore random: the step does not depend on it for dapo, grpo and dr_grpo (the micro losses add
  up to a function of the whole batch, below), it does for bnpo. ``shuffle_micro_batches=False``
  keeps the prompt-major order.

Advantages (grpo_trainer.py:2760-2810: one reward function, sum_then_normalize)
-------------------------------------------------------------------------------
``scale_rewards`` (grpo_config.py:789; ``True`` is read as "group" and ``False`` as "none",
grpo_config.py:1078):

- group: A = (r - mean_group(r)) / (std_group(r) + 1e-4)   (grpo_trainer.py:2765-2771,
  grpo_trainer.py:2785-2787)
- batch: A = (r - mean_group(r)) / (std_batch(r) + 1e-4)   (grpo_trainer.py:2774-2777), std over the
  whole generation batch, gathered over processes; the mean stays the group's
- none:  A = r - mean_group(r)

std is Bessel-corrected (n - 1; ``nanstd``, utils.py:1021); a group is the G consecutive completions
of one prompt. A completion for which every reward is None gets A = 0 (grpo_trainer.py:2810).

Loss (grpo_trainer.py:3020-3182)
--------------------------------
Per completion token t of completion i (``mask`` = the completion's tokens, grpo_trainer.py:2497):

- logp = log_softmax(logits / temperature)[token]. TRL's fused LM head divides the logits by
  ``temperature`` (the sampling temperature) before the log-softmax, for the policy, the old and the
  reference log-probs alike (``add_fused_lm_head(temperature=...)``, grpo_trainer.py:1068-1077,
  utils.py:1548, trl/kernels/chunked_logprob.py:335 ``inv_t``). So the comparison with llmft runs at
  temperature 1.0 unless llmft scales its training log-probs the same way.
- ratio = exp(logp - logp_old); logp_old = logp.detach() when num_iterations == 1 and
  steps_per_generation == gradient_accumulation_steps (grpo_trainer.py:3065-3066), else the
  log-probs computed under no_grad at generation time (grpo_trainer.py:2642-2656).
- per_token_loss = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
  (grpo_trainer.py:3112-3120; ``epsilon_high`` None means epsilon, grpo_trainer.py:946).
- beta > 0: + beta * kl (grpo_trainer.py:3149-3150), kl = exp(ref - logp) - (ref - logp) - 1 (k3,
  grpo_trainer.py:3098-3102), multiplied by ratio when ``use_bias_correction_kl`` (default True,
  grpo_config.py:972; grpo_trainer.py:3104-3105). On-policy the ratio's value is 1 but it is
  differentiable, so the KL gradient gains ``kl * grad(logp)``. The reference is the model with its
  adapters disabled (LoRA, grpo_trainer.py:2722-2737) or a model loaded again from the model dir
  (full fine-tune, grpo_trainer.py:987-1003).

One micro-batch (mb) of an optimizer step with GA accumulation steps and P processes is normalised
as below (grpo_trainer.py:3153-3182); the Trainer does not divide again (``loss_is_scaled_for_ga =
True``, grpo_trainer.py:285) and DDP averages the gradients over the P processes:

- dapo (the default, grpo_config.py:801), cispo, vespo: sum_mb(per_token_loss) / (N / P x GA /
  steps_per_generation), N = the completion tokens of the whole generation batch over all processes
  (``num_items_in_batch``, grpo_trainer.py:2497-2498). With steps_per_generation = GA (the default)
  the step's loss is the sum over every completion token of the step / N: the global token mean,
  whatever the split into micro-batches and processes. (With a generation batch spanning several
  optimizer steps each step divides by N x GA / steps_per_generation, the generation batch's mean
  tokens per step, not its own count.)
- grpo, sapo: the micro-batch's mean over completions of each completion's token mean, / GA. With
  equal micro-batches: the mean over the step's completions of their token means.
- bnpo: sum_mb / tokens_mb / GA: a token mean per micro-batch, then the mean over micro-batches.
- dr_grpo: sum_mb / (completions_mb x max_completion_length) / GA; with equal micro-batches, the sum
  over the step's tokens / (completions x max_completion_length).
- luspo: the micro-batch's mean over completions of each completion's token sum, / GA.

Tokens (what the llmft side must match)
---------------------------------------
- prompt ids: ``tokenizer(text=prompts)["input_ids"]``, with the tokenizer's special tokens
  (grpo_trainer.py:1758); for the byte tokenizer: bos, then the prompt's bytes.
- completion ids (this harness): ``tokenizer(completion, add_special_tokens=False)`` + eos when
  ``append_eos`` (unless it already ends with eos), cut after the first id in
  ``trainer.eos_token_ids`` (TRL's rule for generated ids, grpo_trainer.py:1880-1885; eos_token_ids
  = the tokenizer's eos plus the model's generation_config eos ids, grpo_trainer.py:409-416) and to
  ``max_completion_length`` tokens (what generate with max_new_tokens gives). That is llmft's
  prompt/completion rule (llmft/data/encode.py: prompt with special tokens, completion without, eos
  appended once). Every token of the cut completion, eos included, is a loss token; nothing after
  the first eos is.
- rows: prompts left-padded, completions right-padded with the pad id (grpo_trainer.py:2443-2462).
  The model gets that attention mask and no position ids, so a left-padded prompt's tokens sit at
  positions shifted by its padding (transformers' Llama numbers positions from the first column).
  RoPE depends only on relative positions: the log-probs equal the unpadded row's up to float
  rounding (``reference_grpo_step`` runs every row unpadded from position 0 and matches).
- the reward function sees ``tokenizer.batch_decode(completion_ids, skip_special_tokens=True)``
  (grpo_trainer.py:2247): the injected text, for the byte tokenizer.

Off here: dropout (``disable_dropout``, grpo_trainer.py:1005-1009), gradient checkpointing (TRL's
default is on; it changes nothing numerically), vLLM and its importance sampling correction,
``mask_truncated_completions``, ``top_entropy_quantile`` (1.0), the entropy bonus (``entropy_coef``
0), ``delta``, the off-policy mask, logging and saving. Optimizer: plain SGD (no momentum), constant
lr, no warmup, no weight decay, no clipping.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from unittest import mock

import torch

if TYPE_CHECKING:
    from peft import LoraConfig

RewardFn = Callable[..., float]  # reward_fn(prompt=..., completion=...) -> float


@dataclass
class Generation:
    """One generation batch as TRL saw it, in its order (prompt-major: each prompt's G in a row)."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # what TRL trains on: cut, eos included where appended
    completions: list[str]  # what the reward function saw (TRL's decode of completion_ids)
    rewards: list[float]
    advantages: list[float]
    num_items_in_batch: int  # completion tokens of the generation batch (dapo's N)


@dataclass
class TrlGrpoRun:
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    generations: list[Generation] = field(default_factory=list)
    # each micro-step's rows, as (prompt ids, completion ids) without padding, in the order TRL ran them
    micro_batches: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # each micro-step's loss as TRL backpropagated it


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def weight_diffs(ours: dict, theirs: dict, initial: dict) -> dict[str, float]:
    """How far two runs from the same ``initial`` weights ended apart:

    - update: ||ours - theirs|| / ||theirs - initial|| over all tensors together (the steps' error
      relative to the steps themselves);
    - update_max: the largest such ratio of a single tensor that moved. A small update to weights
      near 1 (a norm's) is only resolved to fp32's ulp there (~1e-7), so this one is ~1e-5 noisy;
    - weights: the largest ||ours - theirs|| / ||theirs|| of a tensor.
    """
    assert ours.keys() == theirs.keys() == initial.keys()
    keys = sorted(ours)
    err = torch.cat([(ours[k].float() - theirs[k].float()).flatten() for k in keys])
    step = torch.cat([(theirs[k].float() - initial[k].float()).flatten() for k in keys])
    rel = lambda a, b: float(a.norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    moved = [k for k in keys if (theirs[k] != initial[k]).any()]
    return {
        "update": rel(err, step),
        "update_max": max(rel(ours[k] - theirs[k], theirs[k] - initial[k]) for k in moved),
        "weights": max(rel(ours[k] - theirs[k], theirs[k]) for k in keys),
    }


def completion_token_ids(tokenizer, text: str, *, append_eos: bool = True, eos_ids=None, max_len=None) -> list[int]:
    """A completion's ids as the harness injects them: the text without special tokens, eos appended
    once (``append_eos``), cut after the first of ``eos_ids`` and to ``max_len`` tokens."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if append_eos and (not ids or ids[-1] != eos):
        ids.append(eos)
    stops = set(eos_ids if eos_ids is not None else [eos])
    first = next((t for t, i in enumerate(ids) if i in stops), None)
    if first is not None:
        ids = ids[: first + 1]
    return ids[:max_len] if max_len is not None else ids


def _trainer_class():
    from trl import GRPOTrainer

    class InjectedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation returns the given completions (the vLLM path's contract:
        a list of completion ids per prompt row, no sampling logprobs)."""

        def setup_injection(self, completions, append_eos, record: TrlGrpoRun):
            self._inject = completions
            self._append_eos = append_eos
            self._seen: dict[str, int] = {}
            self._record = record
            tok = self._tokenizer
            self._prompt_of = {}
            for prompt in completions:
                ids = tuple(tok(text=[prompt])["input_ids"][0])  # as _tokenize_prompts does (grpo_trainer.py:1758)
                if self._prompt_of.setdefault(ids, prompt) != prompt:
                    raise ValueError(f"prompts {prompt!r} and {self._prompt_of[ids]!r} tokenize alike")

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            out = []
            for ids in prompt_ids:
                prompt = self._prompt_of[tuple(ids)]
                k = self._seen.get(prompt, 0)
                self._seen[prompt] = k + 1
                texts = self._inject[prompt]
                out.append(
                    completion_token_ids(
                        self._tokenizer,
                        texts[k % len(texts)],
                        append_eos=self._append_eos,
                        eos_ids=self.eos_token_ids,
                        max_len=self.max_completion_length,
                    )
                )
            return out, None

        def _generate(self, prompts):
            out = super()._generate(prompts)
            self._last_generated = (list(prompts), out[0], out[1], out[3])
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._last_rewards = rewards.sum(dim=1).tolist()
            return rewards

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if self.model.training:
                prompts, prompt_ids, completion_ids, completions = self._last_generated
                self._record.generations.append(
                    Generation(
                        prompts=prompts,
                        prompt_ids=[list(p) for p in prompt_ids],
                        completion_ids=[list(c) for c in completion_ids],
                        completions=list(completions),
                        rewards=self._last_rewards,
                        advantages=output["advantages"].tolist(),
                        num_items_in_batch=int(output["num_items_in_batch"]),
                    )
                )
            return output

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            rows = []
            for p, pm, c, cm in zip(
                inputs["prompt_ids"],
                inputs["prompt_mask"],
                inputs["completion_ids"],
                inputs["completion_mask"],
                strict=True,
            ):
                rows.append((tuple(p[pm.bool()].tolist()), tuple(c[cm.bool()].tolist())))
            self._record.micro_batches.append(rows)
            self._record.losses.append(float(loss.detach()))
            return loss

    return InjectedGRPOTrainer


def trl_grpo_run(
    model_dir: str | Path,
    prompts: list[str],
    completions: dict[str, list[str]],
    reward_fn: RewardFn,
    *,
    num_generations: int,
    per_device_batch: int,
    grad_accum: int,
    steps: int,
    lr: float,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    scale_rewards: str = "group",
    num_iterations: int = 1,
    lora: LoraConfig | dict | None = None,
    initial_adapters: dict[str, torch.Tensor] | None = None,
    max_completion_length: int = 64,
    append_eos: bool = True,
    temperature: float = 1.0,
    use_bias_correction_kl: bool = True,
    shuffle_micro_batches: bool = True,
    seed: int = 0,
) -> TrlGrpoRun:
    """``steps`` optimizer steps of TRL's GRPOTrainer on ``model_dir`` (fp32, CPU, eager attention).

    - ``prompts``: the dataset, in order (``shuffle_dataset=False``; see the module docstring for
      which prompts each step takes).
    - ``completions``: prompt -> its completions. The n-th time (counted over the whole run) TRL
      asks for a completion of a prompt it gets ``completions[prompt][n % len(...)]``: with G
      strings, the k-th row of a prompt's group is its k-th string.
    - ``reward_fn(prompt=..., completion=...)`` -> float; called with TRL's decode of the ids.
    - ``lora``: a ``peft.LoraConfig`` or its kwargs (TRL wraps the model); ``initial_adapters``:
      trainable weights by name (``trainable(model)``'s names) set before the first step (LoRA's A
      is random at init). A full fine-tune's reference (beta > 0) is the model dir, whatever
      ``initial_adapters`` sets.
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    missing = sorted({p for p in prompts if p not in completions})
    if missing:
        raise ValueError(f"no completions for {missing}")
    peft_config = lora
    if isinstance(lora, dict):
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", **lora)

    out_dir = tempfile.mkdtemp(prefix="trl-grpo-peer-")
    record = TrlGrpoRun(initial={}, final={})
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        args = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=per_device_batch,
            gradient_accumulation_steps=grad_accum,
            num_generations=num_generations,
            max_steps=steps,
            learning_rate=lr,
            optim="sgd",
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=0.0,  # 0: no clipping
            beta=beta,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            loss_type=loss_type,
            scale_rewards=scale_rewards,
            num_iterations=num_iterations,
            max_completion_length=max_completion_length,
            temperature=temperature,
            use_bias_correction_kl=use_bias_correction_kl,
            shuffle_dataset=False,
            disable_dropout=True,
            gradient_checkpointing=False,
            mask_truncated_completions=False,
            top_entropy_quantile=1.0,
            entropy_coef=0.0,
            use_vllm=False,
            bf16=False,
            fp16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            log_completions=False,
            dataloader_num_workers=0,
            seed=seed,
        )

        def reward(prompts, completions, **_):  # TRL's reward-function signature
            return [float(reward_fn(prompt=p, completion=c)) for p, c in zip(prompts, completions, strict=True)]

        trainer = _trainer_class()(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": list(prompts)}),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            peft_config=peft_config,
        )
        trainer.setup_injection(completions, append_eos, record)
        if initial_adapters is not None:
            with torch.no_grad():
                params = dict(trainer.model.named_parameters())
                for name, value in initial_adapters.items():
                    params[name].copy_(value)
        record.initial = trainable(trainer.model)
        keep_order = (
            nullcontext()
            if shuffle_micro_batches
            else mock.patch("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda d: d)
        )
        with keep_order:
            trainer.train()
        record.final = trainable(trainer.model)
        return record
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def trl_grpo_weights(model_dir, prompts, completions, reward_fn, **kwargs) -> dict[str, torch.Tensor]:
    """The trainable weights after ``trl_grpo_run``'s steps (same arguments)."""
    return trl_grpo_run(model_dir, prompts, completions, reward_fn, **kwargs).final


# --- the same step in plain torch ---------------------------------------------------------------


def advantages_of(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """TRL's advantages (grpo_trainer.py:2757-2795) of one generation batch's rewards, prompt-major."""
    groups = rewards.view(-1, num_generations)
    centred = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = groups.std(dim=1, unbiased=True).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = rewards.std(unbiased=True).expand_as(rewards)
    else:
        raise ValueError(scale_rewards)
    return centred / (std + 1e-4)


def completion_logps(model, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0):
    """log p(completion token | everything before it), one unpadded row from position 0."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)


def reference_grpo_step(
    model: torch.nn.Module,
    batch: list[tuple[list[int], list[int], float]],
    *,
    num_generations: int,
    lr: float,
    loss_type: str = "dapo",
    scale_rewards: str = "group",
    beta: float = 0.0,
    ref_model: torch.nn.Module | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    old_logps: list[torch.Tensor] | None = None,
    use_bias_correction_kl: bool = True,
) -> dict[str, Any]:
    """One SGD step of GRPO on ``batch`` (a generation batch = one optimizer step: (prompt ids,
    completion ids, reward) rows, prompt-major, each prompt's G rows in a row), in place on
    ``model``'s trainable parameters.

    ``old_logps`` (num_iterations > 1): each row's log-probs when it was generated; None: on-policy
    (ratio = 1 with gradient). The reference (beta > 0) is ``ref_model``, or ``model`` with its
    adapters disabled when it is a PEFT model. Returns the loss, the advantages, each row's
    log-probs before the step (the ``old_logps`` of later iterations on the same batch) and the
    number of tokens whose clipped term was active.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    rewards = torch.tensor([r for _, _, r in batch], dtype=torch.float32)
    adv = advantages_of(rewards, num_generations, scale_rewards)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    per_row, logps_before, clipped = [], [], 0
    for i, (prompt, completion, _) in enumerate(batch):
        logp = completion_logps(model, prompt, completion, temperature)
        logps_before.append(logp.detach())
        old = logp.detach() if old_logps is None else old_logps[i]
        ratio = torch.exp(logp - old)
        clipped_ratio = ratio.clamp(1 - epsilon, 1 + eps_high)
        loss = -torch.min(ratio * adv[i], clipped_ratio * adv[i])
        clipped += int((((ratio < 1 - epsilon) & (adv[i] < 0)) | ((ratio > 1 + eps_high) & (adv[i] > 0))).sum())
        if beta != 0.0:
            with torch.no_grad():
                if ref_model is not None:
                    ref = completion_logps(ref_model, prompt, completion, temperature)
                else:
                    with model.disable_adapter():
                        ref = completion_logps(model, prompt, completion, temperature)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            loss = loss + beta * (kl * ratio if use_bias_correction_kl else kl)
        per_row.append(loss)
    tokens = sum(len(c) for _, c, _ in batch)
    if loss_type in ("dapo", "bnpo"):  # bnpo: this is one micro-batch
        total = sum(r.sum() for r in per_row) / tokens
    elif loss_type == "grpo":
        total = sum(r.mean() for r in per_row) / len(per_row)
    elif loss_type == "dr_grpo":
        total = sum(r.sum() for r in per_row) / (len(per_row) * max_completion_length)
    else:
        raise ValueError(loss_type)
    total.backward()
    with torch.no_grad():
        for p in params:
            p.sub_(lr * p.grad)
            p.grad = None
    return {"loss": float(total.detach()), "advantages": adv, "logps": logps_before, "clipped": clipped}

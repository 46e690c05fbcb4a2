"""The TRL GRPO peer harness (tests/trl_grpo_peer.py) on its own, before any llmft GRPO exists:
TRL trains on exactly the injected completions, tokenized as llmft tokenizes a prompt/completion
record; its dapo step does not depend on the accumulation split; and a few lines of plain torch
(``reference_grpo_step``) land on TRL's weights."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import save_tiny_pretrained
from trl_grpo_peer import completion_token_ids, reference_grpo_step, trl_grpo_run, weight_diffs

G, LR = 2, 0.5
WORDS = ["abc", "hello", "xy", "qrstuvw"]
PROMPTS = [f"reverse {w}:" for w in WORDS]
# Each prompt's G completions, of different lengths (so token and sequence means differ): the right
# answer, and a wrong one.
COMPLETIONS = {f"reverse {w}:": [w[::-1], f"{w}?!{w}" if i % 2 else "no"] for i, w in enumerate(WORDS)}


def reward(prompt: str, completion: str) -> float:
    word = prompt.removeprefix("reverse ").removesuffix(":")
    return float(completion == word[::-1]) + 0.1 * len(completion)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("grpo-peer") / "model", seed=1)


def run(model_dir, **kw):
    args = dict(num_generations=G, per_device_batch=4, grad_accum=1, steps=2, lr=LR)
    return trl_grpo_run(model_dir, PROMPTS, COMPLETIONS, reward, **{**args, **kw})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def same_steps(ours: dict, theirs: dict, initial: dict, tol: float) -> dict[str, float]:
    """Two runs took the same steps: the updates agree within ``tol`` overall and within 10 x ``tol``
    per tensor (a small tensor's update is only resolved to fp32's ulp, see ``weight_diffs``)."""
    d = weight_diffs(ours, theirs, initial)
    assert d["update"] <= tol and d["update_max"] <= 10 * tol and d["weights"] <= tol, d
    return d


def test_trl_trains_on_the_injected_completions(model_dir):
    from transformers import AutoTokenizer

    from llmft.data.encode import IGNORE_INDEX, Encoder
    from llmft.data.records import PromptCompletion

    out = run(model_dir, per_device_batch=2, grad_accum=2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    encoder = Encoder(tok, "completion")
    assert len(out.generations) == 2 and len(out.micro_batches) == 4 and len(out.losses) == 4
    for step, gen in enumerate(out.generations):
        # Step s takes prompts [2s, 2s + 1] in dataset order, each repeated G times in a row, the
        # k-th row of a group getting the prompt's k-th completion.
        step_prompts = PROMPTS[2 * step : 2 * step + 2]
        assert gen.prompts == [p for p in step_prompts for _ in range(G)]
        assert gen.completions == [c for p in step_prompts for c in COMPLETIONS[p]]  # what the reward saw
        assert gen.rewards == pytest.approx([reward(p, c) for p, c in zip(gen.prompts, gen.completions, strict=True)])
        expected = []
        for prompt, text in zip(gen.prompts, gen.completions, strict=True):
            # llmft's prompt/completion encoding (prompt with bos, completion, eos) is TRL's split
            ex = encoder.encode(PromptCompletion(prompt, text))
            start = next(t for t, lab in enumerate(ex.labels) if lab != IGNORE_INDEX)
            ids, labels = [int(i) for i in ex.input_ids], [int(i) for i in ex.labels]
            assert labels[start:] == ids[start:]
            expected.append((tuple(ids[:start]), tuple(ids[start:])))
            assert ids[start:][-1] == tok.eos_token_id and ids[0] == tok.bos_token_id
        assert list(zip(map(tuple, gen.prompt_ids), map(tuple, gen.completion_ids), strict=True)) == expected
        assert gen.num_items_in_batch == sum(len(c) for _, c in expected)
        # The two micro-batches of the step hold exactly these rows (in TRL's random split)
        trained = out.micro_batches[2 * step] + out.micro_batches[2 * step + 1]
        assert Counter(trained) == Counter(expected)
        assert all(len(mb) == 2 for mb in out.micro_batches[2 * step : 2 * step + 2])


def test_prompt_major_micro_batches_without_eos(model_dir):
    """``shuffle_micro_batches=False``: the micro-batches are the generation batch's rows in order;
    ``append_eos=False``: the completions end without eos and are trained on as they are."""
    out = run(model_dir, per_device_batch=2, grad_accum=2, steps=1, append_eos=False, shuffle_micro_batches=False)
    (gen,) = out.generations
    assert gen.completions == [c for p in PROMPTS[:2] for c in COMPLETIONS[p]]
    assert [len(c) for c in gen.completion_ids] == [len(c) for c in gen.completions]  # bytes, no eos
    rows = list(zip(map(tuple, gen.prompt_ids), map(tuple, gen.completion_ids), strict=True))
    assert out.micro_batches == [rows[:2], rows[2:]]


def test_completion_ids_eos_and_cut(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_id
    assert completion_token_ids(tok, "ab") == [97, 98, eos]
    assert completion_token_ids(tok, "ab", append_eos=False) == [97, 98]
    assert completion_token_ids(tok, "ab<eos>cd") == [97, 98, eos]  # cut after the first eos, like TRL
    assert completion_token_ids(tok, "abcdef", max_len=3) == [97, 98, 99]  # generation's max_new_tokens


def test_dapo_step_does_not_depend_on_the_accumulation_split(model_dir):
    """dapo divides by the completion tokens of the whole generation batch (num_items_in_batch):
    4 completions in one micro-batch and 2 x 2 accumulated are the same step. So is grpo (the mean
    of per-completion means, / accumulation steps, over equal micro-batches); grpo is not dapo."""
    one = run(model_dir, per_device_batch=4, grad_accum=1)
    two = run(model_dir, per_device_batch=2, grad_accum=2)
    assert one.initial.keys() == two.initial.keys()
    assert all(torch.equal(one.initial[k], two.initial[k]) for k in one.initial)
    split = same_steps(two.final, one.final, one.initial, 1e-5)
    grpo_one = run(model_dir, per_device_batch=4, grad_accum=1, loss_type="grpo")
    grpo_two = run(model_dir, per_device_batch=2, grad_accum=2, loss_type="grpo")
    grpo_split = same_steps(grpo_two.final, grpo_one.final, one.initial, 1e-5)
    control = weight_diffs(grpo_one.final, one.final, one.initial)
    print(f"dapo 4x1 vs 2x2: {split}; grpo 4x1 vs 2x2: {grpo_split}; grpo vs dapo: {control}")
    assert control["update"] > 0.1


CASES = {
    # name: trl_grpo_run kwargs (lora: LoRA from adapters with a random B, so the KL acts from step 1)
    "dapo-full-accum": dict(per_device_batch=2, grad_accum=2),
    "grpo-lora-kl-batch-temp": dict(
        loss_type="grpo", beta=0.2, scale_rewards="batch", temperature=0.7, lora=dict(r=4, lora_alpha=8)
    ),
    "dr_grpo-full-kl-none": dict(loss_type="dr_grpo", beta=0.1, scale_rewards="none", max_completion_length=16),
    "dapo-full-iterations-clip": dict(num_iterations=2, epsilon=0.02, epsilon_high=0.05, steps=4),
}


def load(model_dir, lora: dict | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora)) if lora else model


def reference_run(model_dir, trl, kw: dict, **override) -> tuple[dict, int]:
    """``reference_grpo_step`` over TRL's generation batches (each ``num_iterations`` times) from
    TRL's initial weights: the final trainable weights and the tokens whose clip was active."""
    kw = {**kw, **override}
    model = load(model_dir, kw.get("lora"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in trl.initial.items():
            params[name].copy_(value)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trl.initial.keys()
    model.train()  # dropout is 0 in the tiny config
    ref_model = load(model_dir).eval() if kw.get("beta") and not kw.get("lora") else None
    iterations = kw.get("num_iterations", 1)
    names = ("loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high", "temperature", "use_bias_correction_kl")
    options = {k: kw[k] for k in names if k in kw}
    clipped = 0
    for gen in trl.generations:
        batch = list(zip(gen.prompt_ids, gen.completion_ids, gen.rewards, strict=True))
        old = None
        for it in range(iterations):
            out = reference_grpo_step(
                model,
                batch,
                num_generations=G,
                lr=LR,
                ref_model=ref_model,
                max_completion_length=kw.get("max_completion_length"),
                old_logps=old if iterations > 1 else None,
                **options,
            )
            if it == 0:
                old = out["logps"]
                assert out["advantages"].tolist() == pytest.approx(gen.advantages, abs=1e-5)
            clipped += out["clipped"]
    assert len(trl.generations) * iterations == kw.get("steps", 2)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, clipped


@pytest.mark.parametrize("case", list(CASES))
def test_plain_torch_reference_step_matches_trl(model_dir, case):
    """``reference_grpo_step`` (unpadded rows from position 0, per-group advantages, the clipped
    surrogate, TRL's normaliser, SGD) reproduces TRL's weights step by step."""
    kw = dict(CASES[case])
    if "lora" in kw:
        torch.manual_seed(5)
        adapters = load(model_dir, kw["lora"]).named_parameters()
        kw["initial_adapters"] = {n: p.detach() + 0.1 * torch.randn_like(p) for n, p in adapters if p.requires_grad}
    trl = run(model_dir, **kw)
    if "lora" in kw:
        assert all(torch.equal(trl.initial[n], v) for n, v in kw["initial_adapters"].items())
    ours, clipped = reference_run(model_dir, trl, kw)
    if kw.get("num_iterations", 1) > 1:
        assert clipped > 0  # the later iterations' ratios left the clip range
    moved = max(rel(trl.final[k], trl.initial[k]) for k in ours)
    assert moved > 1e-3
    diff = same_steps(ours, trl.final, trl.initial, 1e-5)
    print(f"{case}: weights moved {moved:.2e}; plain torch vs TRL: {diff}")
    if kw.get("beta"):
        # TRL's KL term is multiplied by the ratio (value 1, gradient grad logp): without it, not TRL's step
        plain_kl, _ = reference_run(model_dir, trl, kw, use_bias_correction_kl=False)
        assert weight_diffs(plain_kl, trl.final, trl.initial)["update"] > 1e-2

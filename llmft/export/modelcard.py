"""The model card of an export: ``README.md`` with the YAML front matter the Hugging Face hub reads.

Everything in it comes from what the run left behind: the checkpoint's ``recipe.yaml`` and
``trainer_state.json`` and the run's ``metrics.jsonl`` (``<run>/checkpoints/step-N`` -> ``<run>``).
The front matter is written with ``huggingface_hub.ModelCardData`` (base_model, library_name,
license, tags, datasets); the license is the base model's where its card is at hand (a local
model dir, or the hub cache), never fetched.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from llmft import __version__
from llmft.checkpoint.layout import STATE_FILE
from llmft.errors import Problem, UserError
from llmft.metrics.plot import read_metrics
from llmft.plan.objectives import DEFAULT_OBJECTIVE, ObjectiveSpec, card_text, registered

log = logging.getLogger("llmft")

CARD = "README.md"
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt")


def write_model_card(step_dir: Path, out: Path) -> Path:
    """Write ``out/README.md`` for the export in ``out`` (an adapter dir or a model dir) of ``step_dir``."""
    facts = card_facts(Path(step_dir), Path(out))
    path = Path(out) / CARD
    path.write_text(render(facts))
    return path


def export_model_card(step_dir: Path, out: Path) -> None:
    """``write_model_card`` for ``llmft export``: a failure is a warning (the export is what matters)."""
    try:
        write_model_card(step_dir, out)
    except Exception as e:
        log.warning("could not write the model card: %s: %s", type(e).__name__, e)


def card_facts(step_dir: Path, out: Path) -> dict[str, Any]:
    recipe = OmegaConf.to_container(OmegaConf.load(step_dir / "recipe.yaml"), resolve=True)
    state_path = step_dir / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    run_dir = step_dir.parent.parent
    train, evals = _final_rows(run_dir / "metrics.jsonl", state.get("step"))
    model, peft = recipe["model"], recipe["peft"]
    return {
        "recipe": recipe,
        "state": state,
        "name": recipe["run"].get("name") or run_dir.resolve().name,
        "adapter": (out / "adapter_config.json").is_file(),
        "base": model.get("name_or_path"),
        "base_is_hub_id": _is_hub_id(model.get("name_or_path")),
        "model_type": (model.get("config") or {}).get("model_type"),
        "method": peft["method"],
        "objective": (recipe.get("train") or {}).get("objective", DEFAULT_OBJECTIVE),
        "quantization": model.get("quantization"),
        "license": _base_license(model.get("name_or_path"), model.get("revision")),
        "data": _sources(recipe["data"]["train"]),
        "train": train,
        "eval": evals,
    }


def _final_rows(path: Path, step: int | None) -> tuple[dict | None, dict | None]:
    """The last train and eval rows up to the checkpoint's step (later rows of a step win)."""
    if not path.is_file():
        return None, None

    try:
        splits = read_metrics(path)
    except UserError:
        return None, None
    last = {}
    for split in ("train", "eval"):
        rows = [r for r in splits.get(split, []) if step is None or r["step"] <= step]
        last[split] = rows[-1] if rows else None
    return last["train"], last["eval"]


def _sources(train: Any) -> list[str]:
    items = train if isinstance(train, list) else [train]
    out = []
    for item in items:
        if isinstance(item, dict):
            item = item.get("path") or item.get("name")
        if item:
            out.append(str(item))
    return out


def _is_hub_id(name: str | None) -> bool:
    """``org/name`` that is not a local path."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    return name.count("/") == 1 and not name.endswith(_DATA_SUFFIXES)


def _base_license(name: str | None, revision: str | None) -> str | None:
    """The base model card's license where the card is on this machine (a local dir or the hub cache)."""
    if not name:
        return None
    card_path: str | None = None
    if (Path(name) / CARD).is_file():
        card_path = str(Path(name) / CARD)
    elif _is_hub_id(name):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, CARD, revision=revision)
            card_path = found if isinstance(found, str) else None
        except Exception:
            card_path = None
    if card_path is None:
        return None
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(card_path).data.to_dict().get("license")
    except Exception:
        return None


def _versions(state: dict) -> dict[str, str]:
    versions = dict(state.get("versions") or {})
    if "llmft" not in versions:
        versions["llmft"] = __version__
    return versions


def _method(f: dict) -> str:
    q = f["quantization"]
    if f["method"] == "none":
        return "full fine-tune" + (f" ({q['bits']}-bit base)" if q else "")
    if q and q.get("bits") == 4:
        return f"QLoRA ({f['method']} on a 4-bit {q.get('quant_type', 'nf4')} base)"
    return f["method"].upper() + (f" on an {q['bits']}-bit base" if q else "")


def _spec(name: str) -> ObjectiveSpec:
    """The record of a checkpoint's objective; one a user module registered, and this process has
    not imported, reads as a causal LM under its own name."""
    return registered(name) or ObjectiveSpec(name=name, title=name, runtime=None, counts="tokens", card=name)


def _objective(recipe: dict) -> str:
    """``train.objective`` in words: its record's ``card``, then the settings it ran with (``card_words``)."""
    spec = _spec((recipe.get("train") or {}).get("objective", DEFAULT_OBJECTIVE))
    return card_text(spec, recipe)


def render(f: dict[str, Any]) -> str:
    from huggingface_hub import ModelCardData

    recipe, state = f["recipe"], f["state"]
    spec = _spec(f["objective"])
    scorer = spec.head == "score"  # a sequence classifier: scores, not text
    tags = ["llmft", "text-classification" if scorer else "text-generation"]
    if spec.tagged:
        tags.append(spec.name)
    if f["method"] != "none":
        tags.append(f["method"])
    if f["quantization"] and f["quantization"].get("bits") == 4 and f["method"] != "none":
        tags.append("qlora")
    data = ModelCardData(
        base_model=f["base"] if f["base_is_hub_id"] else None,
        library_name="peft" if f["adapter"] else "transformers",
        license=f["license"],
        pipeline_tag="text-classification" if scorer else "text-generation",
        tags=tags,
        datasets=[s for s in f["data"] if _is_hub_id(s)] or None,
    )
    base, rows = _rows(f)
    lines = [
        f"# {f['name']}",
        "",
        f"Fine-tuned from {base} with llmft ({_method(f)}).",
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
        "## Results",
        "",
        *_results(f["train"], f["eval"]),
        "",
        "## Versions",
        "",
        "| package | version |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in sorted(_versions(state).items())),
        "",
        "## Use",
        "",
        "```python",
        *_usage(f),
        "```",
        "",
        "## Recipe",
        "",
        "The resolved recipe of the run (`llmft train` takes it as it is):",
        "",
        "```yaml",
        _yaml(recipe).rstrip(),
        "```",
        "",
    ]
    # Front matter by hand rather than ModelCard.from_template: that is a Jinja template, and a
    # recipe may hold "{{" (a chat template).
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


def _rows(f: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    """The base model in words, and the card's "Training" table."""
    recipe, state = f["recipe"], f["state"]
    base = f"`{f['base']}`" if f["base"] else f"a randomly initialised `{f['model_type']}` (built from `model.config`)"
    batch = state.get("batch") or {}
    equation = (
        f"micro {batch['micro_batch_size']} x accumulation {batch['gradient_accumulation_steps']} "
        f"x data-parallel {batch['dp_size']} = global {batch['global_batch_size']}"
        if batch
        else "unknown"
    )
    peft = recipe["peft"]
    q = f["quantization"]
    optim = recipe["optim"]
    rows = [
        ("base model", base),
        ("method", _method(f)),
        ("objective", _objective(recipe)),
        (
            "export",
            "PEFT adapter" if f["adapter"] else "full model (merged)" if f["method"] != "none" else "full model",
        ),
    ]
    if f["method"] != "none":
        targets = peft["target_modules"]
        targets = ", ".join(targets) if isinstance(targets, list) else targets
        rows.append(("adapter", f"r {peft['r']}, alpha {peft['alpha']}, dropout {peft['dropout']}, targets {targets}"))
    if q:
        rows.append(
            ("quantization", f"{q['bits']}-bit ({q.get('quant_type', '')}, double quant {q.get('double_quant')})")
        )
    rows += [
        ("training dtype", recipe["model"]["dtype"]),
        ("data", _data_line(f["data"], state.get("data_sources") or [])),
        ("target tokens trained", f"{state['tokens']:,}" if "tokens" in state else "unknown"),
        ("sequences trained", f"{state['samples']:,}" if "samples" in state else "unknown"),
        ("optimizer steps", str(state.get("step", "unknown"))),
        ("batch", f"{equation} sequences of up to {recipe['data']['max_seq_len']} tokens"),
        (
            "engine",
            f"{state.get('engine', recipe['distributed']['engine'])}, {state.get('world_size', '?')} process(es)",
        ),
        (
            "optimizer",
            f"{optim['name']}, lr {optim['lr']}, {optim['scheduler']} schedule, {optim['warmup_steps']} warmup",
        ),
        ("seed", str(recipe["run"]["seed"])),
    ]
    return base, rows


def _results(train: dict | None, evals: dict | None) -> list[str]:
    out = []
    if train:
        out.append(f"- train loss {train['loss']:.4f} at step {train['step']}")
    if evals:
        numbers = {k: v for k, v in evals.items() if isinstance(v, float)}
        out.append(f"- eval at step {evals['step']}: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers.items()))
    return out or ["- no metrics found beside the checkpoint"]


def _usage(f: dict) -> list[str]:
    scorer = _spec(f["objective"]).head == "score"
    kind, extra = ("SequenceClassification", ", num_labels=1") if scorer else ("CausalLM", "")
    lines = (
        [f"from peft import AutoPeftModelFor{kind}", "from transformers import AutoTokenizer", ""]
        if f["adapter"]
        else [f"from transformers import AutoModelFor{kind}, AutoTokenizer", ""]
    )
    auto = f"AutoPeftModelFor{kind}" if f["adapter"] else f"AutoModelFor{kind}"
    lines += [
        f'model = {auto}.from_pretrained("THIS_DIR_OR_REPO"{extra if f["adapter"] else ""})',
        'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR_OR_REPO")',
    ]
    if scorer and f["adapter"]:  # an adapter dir has no config of its own
        lines.append("model.config.pad_token_id = tokenizer.pad_token_id")
    if scorer:
        lines.append("score = model(**tokenizer(text, return_tensors='pt')).logits[0, 0]  # its last token's score")
    return lines


def _yaml(recipe: dict) -> str:
    return yaml.safe_dump(recipe, sort_keys=False)


def push_to_hub(out: Path, repo: str, *, private: bool = False) -> str:
    """Upload an export directory (model card included) to the hub repo ``repo``; return its URL.

    Needs a hub token (``hf auth login`` or HF_TOKEN) and the network. A failure is a
    ``UserError``: the export itself is complete and can be pushed later.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(out), repo_id=repo, commit_message="Upload from llmft export")
    except Exception as e:
        raise UserError(
            Problem(
                f"--push-to-hub {repo}",
                f"could not push {out} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                "Log in with `hf auth login` (or set HF_TOKEN), check the repo name and the network "
                "(HF_HUB_OFFLINE must be unset); the export is complete, push it later with "
                f"`hf upload {repo} {out}`.",
            )
        ) from None
    return str(url)


def _data_line(sources: list[str], stats: list[dict[str, Any]]) -> str:
    """The training sources, each with its records and tokens when the checkpoint recorded them."""
    if not stats:
        return ", ".join(f"`{s}`" for s in sources) or "unknown"
    return "; ".join(
        f"`{s['source']}`: {s.get('records', 0):,} records, {s.get('tokens', 0):,} tokens "
        f"({s.get('target_tokens', 0):,} trained on)"
        for s in stats
    )

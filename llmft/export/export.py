"""Model folders of a checkpoint, and ``llmft export``: a Hugging Face directory from a checkpoint.

The model part of a (single-process) checkpoint ``checkpoints/step-N/`` (written by
``llmft.model.save.save_model_dir``)::

    model/          exactly what ``save_pretrained`` writes: a PEFT adapter dir
                    (adapter_config.json + adapter_model.safetensors) or a full HF model dir
    tokenizer/      ``tokenizer.save_pretrained``
    recipe.yaml     the resolved recipe (how to rebuild the base model)

Sharded engines write no ``model/``: an FSDP2 step dir holds ``dcp/``, a DeepSpeed one
``deepspeed/``; export consolidates them first (``llmft.export.consolidate``).

An adapter needs its base. A base named by ``model.name_or_path`` is found by that
name. A base built from ``model.config`` exists only as random weights in memory, so
``llmft train`` writes it once with ``llmft.model.save.save_base_model`` to ``checkpoints/base_model/``
(beside the step dirs, so pruning never removes it), from rank 0's model right after the
engine is built: single, DDP and DeepSpeed ZeRO 0-2, where rank 0 holds the whole model.
Under FSDP2 and ZeRO-3 no rank holds it whole after sharding, and gathering it would
materialise it on one rank (docs/design.md, G6), so it is not saved; export then rebuilds it from
``model.config`` and ``run.seed`` (every engine builds a fresh model from that seed), which
gives the same weights as long as torch and transformers are the versions that trained,
and logs a warning saying so.

Weights are written as safetensors. llmft reads safetensors and DCP only; a DeepSpeed
checkpoint is read by DeepSpeed's own code, the one exception (see ``llmft.export.consolidate``).

A stop request (SIGTERM, Ctrl-C, SIGUSR1/2; ``llmft.stop``) during ``export`` stops it between
tensors (a streamed export), between weight files and between its other parts; the output,
built in a temporary sibling, is removed with the consolidation scratch, the checkpoint is only
read, and the command exits 75 (``llmft.stop.STOPPED_EXIT_CODE``). A single library call (a
sharded checkpoint's consolidation, an in-memory merge's ``save_pretrained``) runs to its end first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from llmft import stop
from llmft.checkpoint.layout import (
    ADAPTER_CONFIG,
    BASE_DIR,
    DCP_DIR,
    DS_DIR,
    EXPORTS,
    MODEL_DIR,
    STATE_FILE,
    TOKENIZER_DIR,
    resolve_checkpoint,
)
from llmft.checkpoint.safe_load import without_remote_code
from llmft.checkpoint.verify import check_checkpoint, damaged
from llmft.errors import Problem, UserError, first_line
from llmft.export.consolidate import checkpoint_engine, load_checkpoint_model, offline_recipe
from llmft.export.modelcard import export_model_card
from llmft.model.build import build_model, load_base_model
from llmft.model.heads import LM, model_class, recipe_head
from llmft.model.precision import DTYPES
from llmft.model.save import plain_config, staged
from llmft.model.source import resolve_name
from llmft.plan.engines import engine_spec, load
from llmft.recipe import load_recipe
from llmft.recipe.load import RECIPE_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")


# --- export -------------------------------------------------------------------------------------


def export(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    merge_lora: bool = False,
    trust_remote_code: bool = False,
) -> Path:
    """``llmft export``: a step dir, ``checkpoints/latest`` or a run dir -> a HF directory.

    Default ``out``: ``<run>/exported/step-N`` (``step-N-merged`` with ``merge_lora``).
    ``trust_remote_code`` comes from the command line only, never from the checkpoint (docs/design.md G7).
    """
    with stop.installed(("SIGUSR1", "SIGUSR2"), stop.EXPORTING):
        step_dir = resolve_checkpoint(checkpoint)
        check_checkpoint(step_dir)  # a truncated or corrupt file is named here, not met as a traceback mid-export
        if out is None:
            out = step_dir.parent.parent / EXPORTS / (step_dir.name + ("-merged" if merge_lora else ""))
        try:
            _check_stop()
            done = export_model_dir(step_dir, Path(out), merge_lora=merge_lora, trust_remote_code=trust_remote_code)
        except stop.Stopped:
            log.warning("export stopped: %s was not written (its partial output is removed); %s is untouched",
                        out, step_dir)  # fmt: skip
            raise
        if stop.requested():  # it came during the export's last moment: the export is whole
            log.warning("%s came as the export finished: %s is complete", stop.requested(), done)
        return done


def _check_stop() -> None:
    """``stop.check`` between the parts of an export (the partial output is removed as it ends)."""
    stop.check(stop.EXPORTING)


def export_model_dir(step_dir: Path, out: Path, *, merge_lora: bool, trust_remote_code: bool = False) -> Path:
    """Write ``out``: a PEFT adapter dir (LoRA, no merge) or a full model dir, tokenizer beside it.

    LoRA without ``merge_lora``: the adapter, its ``base_model_name_or_path`` pointing at a
    loadable base (the hub id or local dir of ``model.name_or_path``, or for a
    ``model.config`` base a copy in ``out/base_model``). With ``merge_lora``: the adapter
    merged into the unquantized base in the compute dtype (``model.dtype``). A full
    fine-tune: the model in the compute dtype.
    """
    step_dir, out = Path(step_dir), Path(out)
    recipe = _checkpoint_recipe(step_dir, trust_remote_code)
    dtype = DTYPES[recipe.model.dtype]
    _check_out(out)
    # The tokenizer goes beside the model, and a score head's config takes its pad token: one that
    # does not load is damage, said before any weights are read.
    _step_tokenizer(step_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    if recipe.peft.method == "none" and _sharded_state(step_dir) is not None:
        if merge_lora:
            log.warning("%s holds a full fine-tune, not an adapter: nothing to merge, exporting the model", step_dir)
        with _staged(out) as tmp:
            write_full_streamed(step_dir, recipe, dtype, tmp)
            _check_stop()  # the last check: what is left takes a moment, and then the export is whole
            _copy_tokenizer(step_dir, tmp)
            export_model_card(step_dir, tmp)
        return out
    # beside the output, not in /tmp: a consolidated model can be as large as the export
    with tempfile.TemporaryDirectory(prefix=".llmft-consolidated-", dir=out.parent) as scratch:
        model_dir = _checkpoint_model_dir(step_dir, Path(scratch), trust_remote_code)
        _check_stop()
        is_adapter = (model_dir / ADAPTER_CONFIG).is_file()
        if merge_lora and not is_adapter:
            log.warning("%s holds a full fine-tune, not an adapter: nothing to merge, exporting the model", step_dir)
        with _staged(out) as tmp:
            if not is_adapter:
                _write_full(model_dir, recipe, dtype, tmp)
            elif merge_lora:
                _write_merged(step_dir, model_dir, recipe, dtype, tmp)
            else:
                _write_adapter(step_dir, model_dir, recipe, dtype, tmp, final=out)
            _check_stop()  # the last check: what is left takes a moment, and then the export is whole
            _copy_tokenizer(step_dir, tmp)
            export_model_card(step_dir, tmp)  # README.md with the hub's front matter
    return out


def _checkpoint_recipe(step_dir: Path, trust_remote_code: bool = False) -> Recipe:
    path = step_dir / RECIPE_FILE
    if not path.is_file():
        raise UserError(
            Problem(
                str(step_dir),
                f"has no {RECIPE_FILE}, so it is not a checkpoint written by llmft train",
                "Pass a checkpoints/step-N directory, checkpoints/latest, or a run directory.",
            )
        )
    return without_remote_code(load_recipe(path), path, trust_remote_code=trust_remote_code)  # G7


def _checkpoint_model_dir(step_dir: Path, scratch: Path, trust_remote_code: bool = False) -> Path:
    """``model/`` of the checkpoint; sharded FSDP/ZeRO states are first consolidated into ``scratch``."""
    model_dir = step_dir / MODEL_DIR
    if (model_dir / ADAPTER_CONFIG).is_file() or (model_dir / "config.json").is_file():
        return model_dir
    if (step_dir / STATE_FILE).is_file() and any((step_dir / d).is_dir() for d in (DCP_DIR, DS_DIR)):
        model = load_checkpoint_model(step_dir, adapter_only=True, trust_remote_code=trust_remote_code)[0]
        model.save_pretrained(scratch / MODEL_DIR, safe_serialization=True)
        return scratch / MODEL_DIR
    found = ", ".join(sorted(p.name for p in step_dir.iterdir())) if step_dir.is_dir() else "nothing"
    raise UserError(
        Problem(
            str(step_dir),
            f"has no {MODEL_DIR}/ folder with a Hugging Face model or PEFT adapter, and no sharded "
            f"FSDP/DeepSpeed state (found: {found})",
            "Pass a checkpoints/step-N directory written by llmft train, checkpoints/latest, or a run directory.",
        )
    )


# Weight files of a streamed export hold up to this many bytes (save_pretrained's 5 GB default).
EXPORT_SHARD_BYTES = 5 * 2**30


def _sharded_state(step_dir: Path) -> str | None:
    """The engine (``EngineSpec.sharded_checkpoint``: fsdp, deepspeed) of a checkpoint whose model
    exists only as sharded state."""
    if (step_dir / MODEL_DIR / "config.json").is_file() or not (step_dir / STATE_FILE).is_file():
        return None
    if not any((step_dir / d).is_dir() for d in (DCP_DIR, DS_DIR)):
        return None

    engine = checkpoint_engine(step_dir)
    return engine if engine_spec(engine).sharded_checkpoint else None


def write_full_streamed(step_dir: Path, recipe: Recipe, dtype: torch.dtype, out: Path) -> None:
    """A full fine-tune from FSDP2 / DeepSpeed state written as a HF model dir in ``dtype`` without
    consolidating the model: the model is built on the meta device (names and shapes only), its
    weights are grouped into files of up to ``EXPORT_SHARD_BYTES`` in ``dtype``, and each group is
    read from the checkpoint (DCP loads only the keys asked for; ``zero_to_fp32``'s lazy mode
    gathers one parameter at a time), cast, written and freed. Memory: one file's weights in fp32
    plus its cast, not the model in fp32. Tied weights are written once, as save_pretrained does."""
    from safetensors.torch import save_file

    stream_reader = engine_spec(checkpoint_engine(step_dir)).stream_reader
    assert stream_reader is not None, "only sharded checkpoints are streamed"
    read = load(stream_reader)(step_dir)
    tokenizer = _step_tokenizer(step_dir)  # a score head's config takes its pad token
    model = build_model(offline_recipe(recipe), tokenizer, init_context=lambda: torch.device("meta"))
    entries, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied weight once, under its first name
            seen.add(id(t))
            entries.append((name, t.shape, t.dtype))
    groups: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry[1].numel() * (dtype.itemsize if entry[2].is_floating_point else entry[2].itemsize)
        if groups[-1] and size + nbytes > EXPORT_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        _check_stop()
        file = "model.safetensors" if len(groups) == 1 else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        wanted = {n: torch.empty(shape, dtype=torch.float32 if d.is_floating_point else d) for n, shape, d in group}
        tensors = {n: (t.to(dtype) if t.is_floating_point() else t).contiguous() for n, t in read(wanted).items()}
        del wanted
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    plain_config(model.config, dtype).save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(Problem(str(out), "already exists and is not empty", "Choose another --out, or delete it."))


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """``out`` built in a temporary sibling and renamed into place (complete or absent); refused
    when it exists and is not empty."""
    _check_out(out)
    with staged(out) as tmp:
        yield tmp


def _write_full(model_dir: Path, recipe: Recipe, dtype: torch.dtype, out: Path) -> None:
    # Streamed shard by shard, in the compute dtype like a merged adapter: training may keep fp32
    # master weights, and the model is never whole in memory.
    stream_model(model_dir, out, dtype)


def _write_merged(step_dir: Path, model_dir: Path, recipe: Recipe, dtype: torch.dtype, out: Path) -> None:
    """The adapter merged into the base's weight files, one shard at a time (``stream_model``);
    only where the base has no safetensors files here (a fresh base that training did not save)
    or the adapter is not plain LoRA (DoRA, rank patterns) is the base built and merged by PEFT."""
    base_dir = _base_weights_dir(step_dir, recipe)
    if base_dir is not None and not _has_head(base_dir, recipe_head(recipe)):
        base_dir = None  # e.g. a causal LM's files under a reward model's adapter: the head is built, not streamed
    deltas = lora_deltas(model_dir) if base_dir is not None else None
    if base_dir is not None and deltas is not None:
        stream_model(base_dir, out, dtype, deltas)
        return
    from peft import PeftModel

    log.info(
        "merging in memory: %s",
        "the base has no weight files of this head" if base_dir is None else "not plain LoRA",
    )
    base = _load_base(step_dir, recipe, dtype)
    merged = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
    _save_for_inference(merged, dtype, out)


def _has_head(model_dir: Path, head: str) -> bool:
    """Whether the model dir's architecture is the one of ``head`` (a score head: a sequence classifier)."""
    if head == LM:
        return True
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


# --- streaming: one weight file in memory at a time ----------------------------------------------


@dataclass
class LoraDeltas:
    """What merging a LoRA adapter changes, by base weight name: ``W + scale * B @ A``, or a
    trained copy (``modules_to_save``) that replaces the weight."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    replaced: dict[str, torch.Tensor]

    def apply(self, key: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if key in self.replaced:
            return self.replaced.pop(key).to(dtype)
        if key in self.factors:
            a, b, scale = self.factors.pop(key)
            # As PEFT's merge: the base in its dtype plus the fp32 delta cast to that dtype.
            return weight.to(dtype) + ((b.float() @ a.float()) * scale).to(dtype)
        return weight.to(dtype)


def lora_deltas(adapter_dir: Path) -> LoraDeltas | None:
    """The merge of a PEFT adapter dir as per-weight deltas; None where it is not plain LoRA."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if (
        config.get("peft_type") != "LORA"
        or config.get("use_dora")
        or config.get("fan_in_fan_out")
        or config.get("lora_bias")
        or config.get("rank_pattern")
        or config.get("alpha_pattern")
        or config.get("target_parameters")  # LoRA on [experts, ., .] weights (docs/moe.md): PEFT merges it
    ):
        return None
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    prefix = "base_model.model."
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    replaced: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            factors[f"{module}.weight"] = (tensor, weights[key.replace(".lora_A.", ".lora_B.")], scale)
        elif ".lora_B." in name:
            continue
        elif "lora_" in name:
            return None  # embeddings adapters, magnitudes: not plain LoRA on a linear
        else:
            replaced[name] = tensor
    return LoraDeltas(factors, replaced)


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors files of a HF model dir (sharded: from its index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else []


def stream_model(model_dir: Path, out: Path, dtype: torch.dtype, deltas: LoraDeltas | None = None) -> None:
    """Copy a HF model dir to ``out`` in ``dtype`` one weight file at a time, merging ``deltas``
    into the weights they touch: memory holds one file (read, merged, written, freed) plus the
    adapter. The files and the index keep their names; the config is the inference config."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    files = weight_files(model_dir)
    weight_map, total = {}, 0
    for name in files:
        merged: dict[str, torch.Tensor] = {}
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                _check_stop()
                merged[key] = deltas.apply(key, f.get_tensor(key), dtype) if deltas else f.get_tensor(key).to(dtype)
                merged[key] = merged[key].contiguous()
                weight_map[key] = name
                total += merged[key].numel() * merged[key].element_size()
        _check_stop()
        save_file(merged, str(out / name), metadata={"format": "pt"})
        del merged
    if deltas is not None and (deltas.factors or deltas.replaced):
        left = sorted([*deltas.factors, *deltas.replaced])
        raise UserError(
            Problem(
                str(model_dir),
                f"the adapter changes weights the base does not have: {left[:5]}",
                "Export the adapter without --merge-lora, or check that the base is the one it was trained on.",
            )
        )
    if (model_dir / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    plain_config(AutoConfig.from_pretrained(model_dir), dtype).save_pretrained(out)
    if (model_dir / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(model_dir).save_pretrained(out)


def _base_weights_dir(step_dir: Path, recipe: Recipe) -> Path | None:
    """Where the base's safetensors files are: the saved base of a fresh model, the local dir of
    ``model.name_or_path``, or its snapshot in the Hugging Face cache (never downloaded here)."""
    m = recipe.model
    if m.config is not None:
        found = _saved_base(step_dir)
    else:
        name = resolve_name(m.name_or_path)
        found = Path(name) if Path(name).is_dir() else _cached_snapshot(name, m.revision)
    return found if found is not None and weight_files(found) else None


def _cached_snapshot(name: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # not in the cache: the in-memory merge loads it the usual way
        return None


def _write_adapter(
    step_dir: Path, model_dir: Path, recipe: Recipe, dtype: torch.dtype, out: Path, *, final: Path
) -> None:
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix not in (".bin", ".pt", ".pth", ".pkl"):
            shutil.copy2(f, out / f.name)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    m = recipe.model
    if m.config is None:
        name = resolve_name(m.name_or_path)
        config["base_model_name_or_path"] = str(Path(name).resolve()) if Path(name).is_dir() else name
        config["revision"] = m.revision
    else:
        _write_base(step_dir, recipe, dtype, out / BASE_DIR)
        # Absolute: transformers resolves a relative path against the working directory, not this folder.
        config["base_model_name_or_path"] = str(final.resolve() / BASE_DIR)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _saved_base(step_dir: Path) -> Path | None:
    for candidate in (step_dir / BASE_DIR, step_dir.parent / BASE_DIR):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _write_base(step_dir: Path, recipe: Recipe, dtype: torch.dtype, out: Path) -> None:
    saved = _saved_base(step_dir)
    if saved is not None:
        shutil.copytree(saved, out, copy_function=_copy_unless_stopped)
        return
    _save_for_inference(_load_base(step_dir, recipe, dtype), dtype, out)


def _copy_unless_stopped(src: str, dst: str) -> None:
    _check_stop()
    shutil.copy2(src, dst)


def _load_base(step_dir: Path, recipe: Recipe, dtype: torch.dtype) -> PreTrainedModel:
    head = recipe_head(recipe)
    saved = _saved_base(step_dir) if recipe.model.config is not None else None
    if saved is not None:
        return model_class(head).from_pretrained(
            saved, dtype=dtype, use_safetensors=True, use_kernels=recipe.model.hub_kernels
        )
    if recipe.model.config is not None:
        log.warning(
            "no saved base model beside %s: rebuilding it from model.config and run.seed=%d; the weights "
            "match training only with the same torch and transformers versions",
            step_dir,
            recipe.run.seed,
        )
    return load_base_model(recipe, dtype=dtype, tokenizer=_step_tokenizer(step_dir))


def _step_tokenizer(step_dir: Path) -> Any:
    """The checkpoint's tokenizer (its pad token goes into a score head's config), or None."""
    if not (step_dir / TOKENIZER_DIR).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(step_dir / TOKENIZER_DIR)
    except Exception as e:  # noqa: BLE001 - tokenizers' and transformers' load errors share no base
        raise damaged(
            step_dir / TOKENIZER_DIR, f"the tokenizer does not load ({type(e).__name__}: {first_line(e)})"
        ) from None


def _save_for_inference(model: PreTrainedModel, dtype: torch.dtype, out: Path) -> None:
    model.to(dtype)
    model.config.use_cache = True  # training turned it off; generation wants it
    model.save_pretrained(out, safe_serialization=True)


def _copy_tokenizer(step_dir: Path, out: Path) -> None:
    src = step_dir / TOKENIZER_DIR
    if not src.is_dir():
        log.warning("%s has no %s/ folder: the export has no tokenizer", step_dir, TOKENIZER_DIR)
        return
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)

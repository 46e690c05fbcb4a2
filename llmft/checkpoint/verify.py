"""Is a checkpoint whole? Cheap structural checks of every file a resume or an export reads.

A checkpoint can be complete (``COMPLETE`` written last) and still be damaged afterwards: a file
truncated by a full disk on a copy, a partial rsync, a bad block. ``check_checkpoint`` reads only headers,
sizes and indexes, never the tensors:

- ``COMPLETE`` holds ``{"step": N}`` (a JSON integer) for its own ``step-N`` and the manifest of
  the files the save wrote (``layout.manifest``): each is there with its size and fingerprint (a
  file from an earlier step or another run is not), and no other file is (``deepspeed_universal/``,
  made later on purpose, aside). Checkpoints saved before the manifest have none; ``recipe.yaml`` is
  a mapping of sections; ``plan.yaml`` (absent in older checkpoints) parses; the files a resume of the checkpoint's engine opens exist;
- safetensors files: the JSON header parses, each tensor has a dtype, shape and offsets, and the
  data fits the file exactly; a model ``config.json`` builds its transformers config;
- ``torch.save`` files (optimizer, RNG, DeepSpeed's): they start with a zip entry and their zip
  index is intact (it is written last, so a truncated file has none);
- DCP folders: ``.metadata`` and every data file it names are present and not empty;
- ``trainer_state.json`` has the fields and JSON types llmft writes, and its step, the marker's
  and the folder's ``step-N`` agree (a disagreement would resume from the wrong step, or from
  none: "nothing to do" with the steps never trained);
- confinement: a checkpoint is read only inside its own folder. ``check_confined`` refuses a
  symbolic link anywhere in it (a reader, llmft's or DeepSpeed's, would follow it to a file
  nobody checked), anything that is not a plain file or folder (a FIFO would block a reader
  forever), and a step dir that is a link leading out of its ``checkpoints/``: the rule
  ``checkpoints/latest`` follows (a name inside ``checkpoints/``, never a path).

For a resume (``resume=True``) the objective's own state is checked too (``check_objective_states``):
its files are loaded with ``weights_only`` and the objective's runtime judges them
(``check_saved_states``: GRPO's kept generation batch is the one the checkpoint's last step
trained on, whole, once, and a checkpoint inside a generation batch has one).

A damaged checkpoint raises ``DamagedCheckpoint`` naming the file; ``llmft train`` then resumes
from the previous complete one (docs/checkpoints.md). A file that cannot be read (permission
denied, an I/O error) is damaged for this purpose too: its error is named.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import zipfile
from pathlib import Path

import yaml

from llmft.checkpoint.layout import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    COMPLETE,
    DCP_DIR,
    DS_DIR,
    DS_TAG,
    MODEL_DIR,
    NOT_IN_MANIFEST,
    OBJECTIVE_DIR,
    OPTIMIZER_FILE,
    RNG_DIR,
    STATE_FILE,
    STEP_RE,
    TrainerState,
    fingerprint,
    objective_files,
    rank_of,
    read_manifest,
    saved_recipe,
)
from llmft.checkpoint.safe_load import torch_load
from llmft.errors import Problem, UserError
from llmft.plan.engines import ENGINE_NAMES, engine_spec, load
from llmft.plan.objectives import DEFAULT_OBJECTIVE, registered
from llmft.plan.resolve import PLAN_FILE
from llmft.plan.shape import check_config_file
from llmft.recipe.load import RECIPE_FILE

log = logging.getLogger("llmft")


class DamagedCheckpoint(UserError):
    """A complete checkpoint with a file that cannot be what llmft wrote."""


# Top-level recipe keys that hold a list, not a section (``rewards``).
LIST_SECTIONS = ("rewards",)


def damaged(path: Path, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        Problem(
            str(path),
            f"is damaged: {what}",
            "Resume from an earlier checkpoint (checkpoint.resume=auto skips damaged ones), or restore the file.",
        )
    )


def _outside(path: Path, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        Problem(
            str(path),
            f"refused: {what}; a checkpoint is read only inside its own folder",
            "Replace it by the file or folder itself (copy with `cp -rL`), or resume from an earlier checkpoint "
            "(checkpoint.resume=auto skips this one).",
        )
    )


def check_checkpoint(step_dir: Path, *, resume: bool = False) -> None:
    """Raise ``DamagedCheckpoint`` naming the first file of ``step_dir`` that is not whole (``resume``:
    or that a resume could not continue exactly from: the objective's state)."""
    step_dir = Path(step_dir)
    files = check_confined(step_dir)
    marked = _check_marker(step_dir)
    try:
        state = TrainerState.read(step_dir)
    except UserError as e:
        raise damaged(step_dir / STATE_FILE, e.problems[0].what) from None
    if state.step != marked:
        raise damaged(step_dir / STATE_FILE, f"says step {state.step}, but the folder is {step_dir.name}")
    try:
        recipe = yaml.safe_load((step_dir / RECIPE_FILE).read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise damaged(step_dir / RECIPE_FILE, f"{type(e).__name__}: {e}".splitlines()[0]) from None
    if not isinstance(recipe, dict) or not all(
        isinstance(v, list if k in LIST_SECTIONS else dict) for k, v in recipe.items()
    ):
        raise damaged(step_dir / RECIPE_FILE, "not a recipe (a mapping of sections such as model:, data:)")
    if (step_dir / PLAN_FILE).exists():  # older checkpoints have none
        try:
            yaml.safe_load((step_dir / PLAN_FILE).read_text())
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise damaged(step_dir / PLAN_FILE, f"{type(e).__name__}: {e}".splitlines()[0]) from None
    _check_present(step_dir, state)
    try:
        _check_files(step_dir)
        _check_manifest(step_dir, files)
    except OSError as e:  # permission denied, an I/O error: the file cannot be what a resume reads
        raise damaged(Path(e.filename or step_dir), f"cannot be read ({e.strerror or e})") from None
    if resume:
        check_objective_states(step_dir, state)


def _check_manifest(step_dir: Path, files: list[Path]) -> None:
    """Every file the save wrote is there as it was written, and nothing else is."""
    listed = read_manifest(step_dir)
    if listed is None:  # saved before the manifest: the other checks are all there is
        return
    for rel, (size, digest) in listed.items():
        path = step_dir / rel
        if not path.is_file():
            raise damaged(path, "missing (the checkpoint was saved with it)")
        now = path.stat().st_size
        if now != size:
            raise damaged(
                path,
                f"not the file the checkpoint was saved with ({now} bytes, {size} when saved: truncated, "
                "replaced, or copied from another checkpoint)",
            )
        if fingerprint(path) != digest:
            raise damaged(
                path,
                "not the file the checkpoint was saved with (its content differs: replaced, or copied from "
                "another checkpoint)",
            )
    for path in files:
        rel = path.relative_to(step_dir)
        if rel.parts[0] in (COMPLETE, *NOT_IN_MANIFEST) or rel.as_posix() in listed:
            continue
        raise DamagedCheckpoint(
            Problem(
                str(path),
                "is damaged: not part of the checkpoint as it was saved (a file its manifest in COMPLETE does not "
                "list: a copy, or a file of another run)",
                "Move it out of the checkpoint folder, or resume from an earlier checkpoint (checkpoint.resume=auto "
                "skips this one).",
            )
        )


def check_objective_states(step_dir: Path, state: TrainerState) -> None:
    """The objective's own state (``objective/rank-<R>.pt``) is what a resume of ``step_dir``
    continues from exactly: loaded with ``weights_only`` and judged by the objective's runtime
    (``check_saved_states``; an objective without one keeps nothing a resume needs)."""
    step_dir = Path(step_dir)
    folder = step_dir / OBJECTIVE_DIR
    if read_manifest(step_dir) is None and folder.is_dir():  # with a manifest, an extra file is damage
        for path in sorted(folder.iterdir()):
            if rank_of(path) is None:
                log.warning("%s: ignored: not a rank-<R>.pt name, so never read as an objective state", path)
    recipe = saved_recipe(step_dir)
    name = (recipe.get("train") or {}).get("objective", DEFAULT_OBJECTIVE)
    spec = registered(name) if isinstance(name, str) else None
    check = getattr(load(spec.runtime), "check_saved_states", None) if spec and spec.runtime else None
    if check is None:
        return
    states = []
    try:
        for path in objective_files(step_dir):
            check_zip(path)
            states.append((path, torch_load(path)))
        global_batch = state.batch.global_batch_size if state.batch is not None else None
        check(states, step_dir, state.step, state.samples, global_batch, recipe)
    except DamagedCheckpoint:
        raise
    except UserError as e:  # the file's own words (refused, damaged), as damage: auto skips the checkpoint
        raise DamagedCheckpoint(*e.problems, title=e.title) from None


def check_confined(step_dir: Path) -> list[Path]:
    """Every file of ``step_dir``, after refusing what would lead a reader outside it: a step dir
    that is a link out of its ``checkpoints/``, any link inside, anything not a plain file or folder."""
    step_dir = Path(step_dir)
    if step_dir.is_symlink() and step_dir.resolve().parent != step_dir.parent.resolve():
        raise _outside(step_dir, f"is a symbolic link to {os.readlink(step_dir)}, outside {step_dir.parent}")
    files = []

    def fail(e: OSError) -> None:
        raise damaged(Path(e.filename or step_dir), f"cannot be read ({e.strerror or e})")

    for folder, dirs, names in os.walk(step_dir, onerror=fail):
        for name in sorted(dirs + names):
            path = Path(folder) / name
            try:
                mode = os.lstat(path).st_mode
            except OSError as e:
                fail(e)
            if stat.S_ISLNK(mode):
                raise _outside(path, f"is a symbolic link (to {os.readlink(path)})")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise DamagedCheckpoint(
                    Problem(
                        str(path),
                        "refused: is not a plain file or folder (a FIFO, socket or device: a reader could wait on "
                        "it forever)",
                        "Replace it by the file llmft wrote, or resume from an earlier checkpoint "
                        "(checkpoint.resume=auto skips this one).",
                    )
                )
            if stat.S_ISREG(mode):
                files.append(path)
    return files


def _check_present(step_dir: Path, state: TrainerState) -> None:
    """The files a resume of ``state.engine``'s checkpoint opens exist (a missing one would be a
    ``FileNotFoundError`` mid-resume, after the choice of checkpoint was made). Which files: the
    engine's record names the check (``EngineSpec.checkpoint_files``)."""
    if state.engine not in ENGINE_NAMES:
        raise damaged(step_dir / STATE_FILE, f"names the engine {state.engine[:40]!r}, which llmft does not have")
    for path in load(engine_spec(state.engine).checkpoint_files)(step_dir):
        if not path.is_file():
            raise damaged(path, "missing")


def plain_files(step_dir: Path) -> list[Path]:
    """A ``save_pretrained`` checkpoint (single, DDP): the adapter or the model's config and weights.
    (A missing RNG file is allowed: a rank that did not exist when it was written; optimizer.pt may
    be gone too: export needs none, and a resume names it if missing.)"""
    model = step_dir / MODEL_DIR
    if (model / ADAPTER_CONFIG).is_file():
        return [model / ADAPTER_CONFIG, model / ADAPTER_WEIGHTS]
    return [model / "config.json", *_model_weights(model)]


def dcp_files(step_dir: Path) -> list[Path]:
    """A DCP checkpoint (FSDP2): its metadata (which names the rest, checked by ``check_dcp``)."""
    return [step_dir / DCP_DIR / ".metadata"]


def deepspeed_files(step_dir: Path) -> list[Path]:
    """A DeepSpeed checkpoint: at least one ``*model_states.pt``."""
    found = sorted((step_dir / DS_DIR / DS_TAG).glob("*model_states.pt"))
    if not found:
        raise damaged(step_dir / DS_DIR / DS_TAG, "holds no DeepSpeed *model_states.pt file")
    return found


def _model_weights(model_dir: Path) -> list[Path]:
    """The weight files of a save_pretrained folder: its index's files (plain names in the folder),
    or ``model.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return [model_dir / "model.safetensors"]
    try:
        doc = json.loads(index.read_text())
    except (OSError, ValueError) as e:
        raise damaged(index, f"not valid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    names = list(weight_map.values()) if isinstance(weight_map, dict) else None
    if not names or not all(isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..") for n in names):
        raise damaged(index, "its weight_map does not name weight files of this folder")
    return [model_dir / n for n in sorted(set(names))]


def _check_files(step_dir: Path) -> None:
    for path in sorted((step_dir / RNG_DIR).glob("*.pt")) + sorted((step_dir / OBJECTIVE_DIR).glob("*.pt")):
        check_zip(path)
    for path in sorted((step_dir / MODEL_DIR).glob("*.safetensors")):
        check_safetensors(path)
    for path in sorted((step_dir / MODEL_DIR).glob("*.json")):
        check_json(path)
    if (step_dir / MODEL_DIR / "config.json").is_file():
        check_model_config(step_dir / MODEL_DIR / "config.json")
    if (step_dir / OPTIMIZER_FILE).exists():
        check_zip(step_dir / OPTIMIZER_FILE)
    if (step_dir / DCP_DIR).is_dir():
        check_dcp(step_dir / DCP_DIR)
    for path in sorted((step_dir / DS_DIR).rglob("*.pt")):
        check_zip(path)


def _check_marker(step_dir: Path) -> int:
    """The step of ``step-N``, which its ``COMPLETE`` marker must name (a JSON integer: ``true``
    or ``1.0`` would compare equal to 1)."""
    marker = step_dir / COMPLETE
    m = STEP_RE.match(step_dir.name)
    try:
        doc = json.loads(marker.read_text())
        step = doc["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise damaged(marker, f"not the marker llmft writes ({type(e).__name__})") from None
    if m is None or type(step) is not int or step != int(m.group(1)):
        raise damaged(marker, f"says step {json.dumps(step)[:40]}, but the folder is {step_dir.name}")
    if "files" in doc and not _is_manifest(doc["files"]):
        raise damaged(marker, "its manifest (files) is not a mapping of relative paths to [size, fingerprint]")
    return step


def _is_manifest(files: object) -> bool:
    def entry(rel: object, value: object) -> bool:
        parts = Path(rel).parts if isinstance(rel, str) else ()
        return (
            bool(parts)
            and not Path(rel).is_absolute()
            and ".." not in parts
            and Path(rel).as_posix() == rel
            and isinstance(value, list)
            and len(value) == 2
            and type(value[0]) is int
            and value[0] >= 0
            and isinstance(value[1], str)
        )

    return isinstance(files, dict) and all(entry(k, v) for k, v in files.items())


def check_json(path: Path) -> None:
    """A model folder's JSON files (config, generation config, adapter config, index) are objects."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise damaged(path, f"not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise damaged(path, "not a JSON object")


def check_model_config(path: Path) -> None:
    """A model ``config.json`` names its ``model_type`` and builds that transformers config class (a
    type transformers does not know, remote code, is left to the loader that is allowed to run it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:  # bounded read and the sizes' arithmetic first (llmft.limits): nothing is built from absurd sizes
        check_config_file(path, against_weights=False)  # model/ of an adapter run holds the adapter only
    except UserError as e:
        raise damaged(path, "; ".join(p.what for p in e.problems)) from None
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise damaged(path, "not a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):  # transformers' AutoConfig cannot load it (remote code has one too)
        raise damaged(path, "has no model_type")
    if model_type not in CONFIG_MAPPING:
        return
    try:
        CONFIG_MAPPING[model_type].from_dict(config)
    except Exception as e:  # noqa: BLE001 - transformers' validation errors share no public base
        raise damaged(path, f"not a valid {model_type} config ({str(e).splitlines()[0][:200]})") from None


def check_safetensors(path: Path) -> None:
    """The header parses and its tensors end exactly where the file does."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
        end = _data_end(header)
    except (OSError, ValueError, struct.error) as e:
        raise damaged(path, f"unreadable safetensors header ({e})") from None
    if 8 + header_len + end != size:
        raise damaged(path, f"{size} bytes on disk, {8 + header_len + end} expected (truncated or appended)")


def _data_end(header: object) -> int:
    """Where the last tensor of a safetensors header ends; ``ValueError`` for an entry without a
    dtype, a shape of whole numbers, or begin <= end offsets."""
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(entry.get("dtype") if isinstance(entry, dict) else None, str)
            or not isinstance(shape, list)
            or not all(type(n) is int and n >= 0 for n in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"tensor {name[:80]!r} lacks a dtype, shape or data_offsets of the right types")
        end = max(end, offsets[1])
    return end


def check_zip(path: Path) -> None:
    """A ``torch.save`` file: its zip index (written last) is intact and every entry lies in the file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # torch.load would take it for its legacy format
                raise zipfile.BadZipFile("it does not start with a zip entry")
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    raise zipfile.BadZipFile(f"{info.filename} runs past the end of the file")
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, OverflowError, struct.error) as e:
        # ValueError: an entry name that is not UTF-8 (a flipped bit in the zip index), among others
        raise damaged(path, f"not a whole torch.save file ({e}); {size} bytes on disk") from None


def check_dcp(dcp_dir: Path) -> None:
    metadata = dcp_dir / ".metadata"
    if not metadata.is_file() or metadata.stat().st_size == 0:
        raise damaged(metadata, "missing or empty (DCP's index of the shards)")
    for data in sorted(dcp_dir.glob("*.distcp")):
        if data.stat().st_size == 0:
            raise damaged(data, "empty shard file")

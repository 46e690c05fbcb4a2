"""``llmft rollout-server RECIPE``: a vLLM engine behind HTTP for ``rollout.vllm.mode: server``.

Started separately (other GPUs or nodes; ``launch/rollout-server.slurm``), it builds the recipe's
model in vLLM without reading its weights (``load_format: dummy``): the trainer streams its weights
in before the first generation, as the colocated engine gets them (``llmft.model.vllm_backend``).
It speaks a small protocol (JSON, and raw tensor bytes), the trainer's ``ServerGenerator`` being its
client:

- ``GET /health``: ``{"ready": true, "lora": <serves an adapter>, "max_model_len": N}``;
- ``POST /generate``: ``{"prompts": [[ids]], "seeds": [seed or null], "params": {...}}`` ->
  ``{"completions": [[ids]], "logprobs": [[floats]]}`` (``vllm_backend.sampling_params``);
- ``POST /update/start``, then ``POST /update/tensor`` per weight (headers ``X-Name``, ``X-Dtype``,
  ``X-Shape``; the body is the tensor's bytes), then ``POST /update/finish``: the weights stream into
  vLLM's layerwise reload as they arrive (a bounded queue: never the whole state dict in memory),
  and no generation runs from ``start`` until ``finish`` (vLLM's pause/resume around an update);
- ``POST /adapter``: a LoRA adapter (the body: safetensors bytes; ``X-Adapter-Config``: PEFT's
  config as JSON) that the next generations use.

Every wait inside the server is bounded by ``distributed.timeout_s``: an update whose next tensor
does not come is abandoned with an error (the engine keeps serving), never a hang.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from llmft.errors import Problem, UserError
from llmft.job.dist import init_distributed, read_env
from llmft.model.source import model_config
from llmft.model.vllm_backend import Engine

if TYPE_CHECKING:
    from llmft.recipe.schema import Recipe

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_END = object()


class RolloutServer:
    """The engine, the lock that serialises its use, and the weight update under way."""

    def __init__(self, recipe: Recipe, timeout_s: float) -> None:
        from transformers import AutoModelForCausalLM

        config = model_config(recipe.model)
        architecture = (config.architectures or [None])[0] or AutoModelForCausalLM._model_mapping[type(config)].__name__
        self.lora = recipe.peft.method == "lora"
        self.timeout_s = timeout_s
        self.max_model_len = recipe.rollout.vllm.max_model_len or recipe.data.max_seq_len
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.engine = Engine(recipe, config, architecture, recipe.peft.r if self.lora else None, device)
        self.lock = threading.Lock()  # one use of the engine at a time; held through a weight update
        self.update: tuple[queue.Queue, threading.Thread, list[BaseException]] | None = None
        self.peers = Peers() if recipe.rollout.vllm.tensor_parallel_size > 1 else None

    # --- weight updates ------------------------------------------------------------------------

    def start_update(self) -> None:
        # held until finish_update: an update under way keeps every other request (a second update too) waiting
        if not self.lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"the engine stayed busy for {self.timeout_s:.0f} s")
        try:
            self._everywhere("begin")
        except BaseException:
            self.lock.release()
            raise

    def put_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if self.update is None:
            raise RuntimeError("no weight update is under way (POST /update/start first)")
        self._everywhere("put", name, tensor)

    def finish_update(self) -> None:
        if self.update is None:
            raise RuntimeError("no weight update is under way")
        try:
            self._everywhere("finish")
        finally:
            self.lock.release()

    def load_adapter(self, body: bytes, config: dict[str, Any]) -> None:
        from safetensors.torch import load

        with self._engine():
            self._everywhere("adapter", load(body), config)

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._engine():
            prompts = request["prompts"]
            ids, logps = self._everywhere("generate", prompts, request["seeds"], [request["params"]] * len(prompts))
        return {"completions": ids, "logprobs": logps}

    @contextlib.contextmanager
    def _engine(self) -> Iterator[None]:
        """The engine, once no weight update (nor another request) holds it: within ``timeout_s``."""
        if not self.lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"the engine stayed busy (a weight update) for {self.timeout_s:.0f} s")
        try:
            yield
        finally:
            self.lock.release()

    # --- every rank of the engine ----------------------------------------------------------------

    def _everywhere(self, op: str, *args: Any) -> Any:
        """One engine operation, on every process of a tensor-parallel engine: rank 0 tells the
        others (``follow``), each runs it, and a failure on any rank is rank 0's error."""
        if self.peers is not None and self.peers.rank == 0:
            self.peers.tell(op, args)
        error: BaseException | None = None
        result = None
        try:
            result = getattr(self, "_" + op)(*args)
        except Exception as e:  # noqa: BLE001 - every rank says how its part went
            error = e
        if self.peers is not None:
            said = self.peers.outcomes(None if error is None else f"{type(error).__name__}: {error}")
            failed = [f"rank {r}: {m}" for r, m in enumerate(said) if m is not None]
            if failed and error is None:
                raise RuntimeError("; ".join(failed))
        if error is not None:
            raise error
        return result

    def follow(self) -> None:
        """A tensor-parallel server's rank > 0: run what rank 0 tells, until it stops."""
        assert self.peers is not None
        while True:
            op, args = self.peers.hear()
            if op == "stop":
                return
            with contextlib.suppress(Exception):  # rank 0 reports it (``_everywhere``)
                self._everywhere(op, *args)

    def _begin(self) -> None:
        tensors: queue.Queue = queue.Queue(maxsize=4)
        errors: list[BaseException] = []

        def stream():
            while True:
                item = tensors.get(timeout=self.timeout_s)  # a client that went away: queue.Empty ends it
                if item is _END:
                    return
                yield item

        def run():
            try:
                self.engine.reload(stream())
            except BaseException as e:  # noqa: BLE001 - handed to the client at finish
                errors.append(e)

        thread = threading.Thread(target=run, name="llmft-weight-update", daemon=True)
        thread.start()
        self.update = (tensors, thread, errors)

    def _put(self, name: str, tensor: torch.Tensor) -> None:
        assert self.update is not None
        tensors, thread, errors = self.update
        if errors or not thread.is_alive():
            raise RuntimeError(f"the update failed: {errors[0] if errors else 'it ended'}")
        tensors.put((name, tensor), timeout=self.timeout_s)

    def _finish(self) -> None:
        assert self.update is not None
        tensors, thread, errors = self.update
        try:
            if thread.is_alive():
                tensors.put(_END, timeout=self.timeout_s)
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"vLLM's reload did not finish within {self.timeout_s:.0f} s")
            if errors:
                raise RuntimeError(f"vLLM's reload failed ({type(errors[0]).__name__}: {errors[0]})")
        finally:
            self.update = None

    def _adapter(self, state: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        self.engine.load_adapter(state, config)

    def _generate(self, prompts, seeds, params) -> tuple[list[list[int]], list[list[float]]]:
        return self.engine.generate(prompts, seeds, params)


class Peers:
    """The processes of a tensor-parallel server (``torchrun --nproc_per_node N llmft rollout-server``,
    N = ``rollout.vllm.tensor_parallel_size``): rank 0 answers HTTP and tells the others each engine
    operation, over a gloo group of their own (operations are small objects; weights go one tensor
    at a time). Ranks > 0 wait for the next operation as long as the server runs: rank 0 waits for
    requests as long as that, and torchrun ends them all when one process ends."""

    def __init__(self) -> None:
        import datetime

        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    def tell(self, op: str, args: tuple) -> None:
        dist.broadcast_object_list([(op, args)], src=0, group=self.group)

    def hear(self) -> tuple[str, tuple]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def outcomes(self, error: str | None) -> list[str | None]:
        said: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(said, error, group=self.group)
        return said


def _handler(server: RolloutServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def _reply(self, code: int, value: dict[str, Any]) -> None:
            body = json.dumps(value).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._reply(404, {"error": f"no {self.path}"})
            self._reply(200, {"ready": True, "lora": server.lora, "max_model_len": server.max_model_len})

        def do_POST(self) -> None:
            try:
                body = self._body()
                if self.path == "/generate":
                    return self._reply(200, server.generate(json.loads(body)))
                if self.path == "/update/start":
                    server.start_update()
                elif self.path == "/update/tensor":
                    shape = json.loads(self.headers["X-Shape"])
                    raw = torch.frombuffer(bytearray(body), dtype=torch.uint8)
                    server.put_tensor(self.headers["X-Name"], raw.view(DTYPES[self.headers["X-Dtype"]]).reshape(shape))
                elif self.path == "/update/finish":
                    server.finish_update()
                elif self.path == "/adapter":
                    server.load_adapter(body, json.loads(self.headers["X-Adapter-Config"]))
                else:
                    return self._reply(404, {"error": f"no {self.path}"})
                self._reply(200, {"ok": True})
            except Exception as e:  # noqa: BLE001 - the client names it in its error
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def serve(recipe: Recipe, host: str, port: int, timeout_s: float, ready=print) -> None:
    """Build the engine and answer until interrupted (rank 0; the other ranks of a tensor-parallel
    engine run what it tells them)."""
    env, tp = read_env(), recipe.rollout.vllm.tensor_parallel_size
    if env.world_size != tp:
        raise UserError(
            Problem(
                "rollout.vllm.tensor_parallel_size",
                f"is {tp}, but llmft rollout-server was started as {env.world_size} process(es): the engine runs one "
                "process per device it spans",
                f"Start it with torchrun --nproc_per_node {tp} -m llmft rollout-server RECIPE ..."
                if tp > 1
                else "Start one process: llmft rollout-server RECIPE ...",
            )
        )
    if env.distributed:
        init_distributed(env, timeout_s=timeout_s)  # vLLM's tensor-parallel groups join this job's world
    server = RolloutServer(recipe, timeout_s)
    if server.peers is not None and server.peers.rank != 0:
        try:
            server.follow()
        finally:
            server.engine.close()
        return
    try:
        httpd = ThreadingHTTPServer((host, port), _handler(server))
    except OSError as e:
        server.engine.close()
        raise UserError(
            Problem("--port", f"cannot listen on {host}:{port} ({e})", "Pick a free port (or stop what holds it).")
        ) from e
    httpd.daemon_threads = True
    spans = f" (tensor parallel {tp})" if tp > 1 else ""
    ready(f"llmft rollout-server: serving {recipe.model.name_or_path or 'model.config'}{spans} on http://{host}:{port}")
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        if server.peers is not None:
            with contextlib.suppress(Exception):
                server.peers.tell("stop", ())
        server.engine.close()

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

from llmft.errors import Problem, UserError
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

    # --- weight updates ------------------------------------------------------------------------

    def start_update(self) -> None:
        # held until finish_update: an update under way keeps every other request (a second update too) waiting
        if not self.lock.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"the engine stayed busy for {self.timeout_s:.0f} s")
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

    def put_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if self.update is None:
            raise RuntimeError("no weight update is under way (POST /update/start first)")
        tensors, thread, errors = self.update
        if errors or not thread.is_alive():
            raise RuntimeError(f"the update failed: {errors[0] if errors else 'it ended'}")
        tensors.put((name, tensor), timeout=self.timeout_s)

    def finish_update(self) -> None:
        if self.update is None:
            raise RuntimeError("no weight update is under way")
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
            self.lock.release()

    def load_adapter(self, body: bytes, config: dict[str, Any]) -> None:
        from safetensors.torch import load

        with self._engine():
            self.engine.load_adapter(load(body), config)

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._engine():
            ids, logps = self.engine.generate(request["prompts"], request["seeds"], request["params"])
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
    """Build the engine and answer until interrupted."""
    server = RolloutServer(recipe, timeout_s)
    try:
        httpd = ThreadingHTTPServer((host, port), _handler(server))
    except OSError as e:
        server.engine.close()
        raise UserError(
            Problem("--port", f"cannot listen on {host}:{port} ({e})", "Pick a free port (or stop what holds it).")
        ) from e
    httpd.daemon_threads = True
    ready(f"llmft rollout-server: serving {recipe.model.name_or_path or 'model.config'} on http://{host}:{port}")
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
        server.engine.close()

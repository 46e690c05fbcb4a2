"""Shared test fixtures: a tiny recipe, tiny variable-length data, and running `llmft train`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 256,
}


def tiny_llama_model(attn: str = "sdpa", **overrides):
    """A LlamaForCausalLM of TINY_LLAMA's shape (``overrides`` replace its keys), seeded 0, fp32,
    in eval mode: for tests that run the model in-process rather than through a recipe."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {k: v for k, v in {**TINY_LLAMA, **overrides}.items() if k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(**shape, attn_implementation=attn)).float().eval()


def packed_and_plain(pad: int = 0) -> tuple[dict, dict]:
    """Examples of odd lengths (some prompt tokens masked) packed into several rows of 16 in one
    micro-batch, and the same examples one per row (padded): the packing equality tests' batches."""
    from llmft.data import collate
    from llmft.data.encode import IGNORE_INDEX, Example
    from llmft.data.pack import pack
    from llmft.data.tokens import TokenDataset

    gen = torch.Generator().manual_seed(1)
    exs = []
    for n, masked in [(5, 2), (9, 0), (3, 1), (7, 4), (12, 3), (4, 0), (6, 1), (10, 2)]:
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        exs.append(Example(ids, [IGNORE_INDEX] * masked + ids[masked:]))
    dataset = TokenDataset(pack(exs, 16, pad))
    packed = collate([dataset[i] for i in range(len(dataset))], pad)
    assert packed["input_ids"].shape[0] >= 3 and "attention_mask" not in packed  # several packed rows
    plain = collate([{"input_ids": e.input_ids, "labels": e.labels, "position_ids": None} for e in exs], pad)
    return packed, plain


# Two ranks on every engine, as the objective tests run them: micro-batches of 2 (ZeRO-3's of 1).
TWO_RANK_ENGINES = {
    "ddp": ["distributed.engine=ddp", "batch.micro_batch_size=2"],
    "fsdp": ["distributed.engine=fsdp", "batch.micro_batch_size=2"],
    "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2", "batch.micro_batch_size=2"],
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3", "batch.micro_batch_size=1"],
}


def engine_cases(variants) -> list:
    """Every (variant, engine) of ``TWO_RANK_ENGINES``: DDP's launch in the default tier, the others
    (a few minutes on 2 shared cores) with -m slow."""
    import pytest

    return [
        pytest.param(variant, engine, id=f"{variant}-{engine}", marks=[pytest.mark.slow] if engine != "ddp" else [])
        for engine in TWO_RANK_ENGINES
        for variant in variants
    ]


def write_data(path: Path, n: int = 64, seed: int = 0, kind: str = "completion") -> Path:
    """Records of very different lengths, so per-micro-batch averaging would visibly differ."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 24)))
            if kind == "text":
                rec = {"text": word * rng.randint(1, 3)}
            else:
                rec = {"prompt": f"reverse {word}:", "completion": word[::-1]}
            f.write(json.dumps(rec) + "\n")
    return path


def write_recipe(tmp: Path, **sections) -> Path:
    """A complete tiny recipe; keyword args are dotted-key overrides baked into the file."""
    import yaml

    data = tmp / "train.jsonl"
    if not data.exists():
        write_data(data)
    recipe = {
        "run": {"output_dir": str(tmp / "run"), "seed": 0, "tensorboard": False},
        "model": {"config": TINY_LLAMA, "dtype": "fp32", "attn_implementation": "eager"},
        "data": {"train": str(data), "max_seq_len": 64, "num_workers": 0},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "optim": {"name": "adamw", "lr": 1e-3, "scheduler": "constant"},
        "train": {"max_steps": 2, "progress_bar": False},
        "checkpoint": {"every_steps": None},
    }
    for key, value in sections.items():
        node = recipe
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def train_inproc(recipe: Path, *overrides: str) -> int:
    from llmft.training.train import train

    return train(str(recipe), list(overrides))


def torchrun_cmd(nproc: int = 2) -> list[str]:
    """``torchrun`` on one machine, rendezvous on loopback at a port the launcher binds itself (port
    0: a port picked here and bound later by torchrun could be taken meanwhile by a concurrent test's
    connection, and the launch would fail with EADDRINUSE)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
    ]


# ``llmft`` with the tests' instrumentation hooks (sample log, fault injection): tests/instrumented.py.
INSTRUMENTED = str(ROOT / "tests" / "instrumented.py")


def llmft_entry(env: dict | None = None) -> list[str]:
    """How a subprocess runs llmft: ``-m llmft``, or the instrumented entry when ``env`` asks for
    instrumentation (LLMFT_SAMPLE_LOG / LLMFT_FAULT_INJECT, read by tests/instrumented.py only)."""
    if env and ({"LLMFT_SAMPLE_LOG", "LLMFT_FAULT_INJECT"} & set(env)):
        return [INSTRUMENTED]
    return ["-m", "llmft"]


def torchrun(
    args: list[str], nproc: int = 2, timeout: int = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [*torchrun_cmd(nproc), *llmft_entry(env), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir: Path, split: str = "train") -> list[dict]:
    """metrics.jsonl rows of one split; where a step appears twice the later row counts."""
    rows: dict[int, dict] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == split:
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Block until ``run_dir``'s metrics.jsonl has a train row at ``step`` or later; fail with the
    process's stderr if it exits first (start it with ``stderr=subprocess.PIPE``)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if (Path(run_dir) / "metrics.jsonl").exists() and any(r["step"] >= step for r in metrics(run_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early: {(proc.communicate()[1] or '')[-4000:]}")
        time.sleep(0.02)
    raise AssertionError("timed out waiting for training progress")


def sample_log(log_dir: Path) -> dict[int, Counter]:
    """step -> multiset of the dataset indices all ranks took in that step, from the per-rank logs
    tests/instrumented.py writes (LLMFT_SAMPLE_LOG)."""
    per_step: dict[int, Counter] = {}
    for f in sorted(Path(log_dir).glob("rank-*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            per_step.setdefault(row["step"], Counter()).update(row["indices"])
    return per_step


def checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Weights of a single-process / DDP checkpoint (adapter or full model)."""
    model_dir = Path(ckpt) / "model"
    for name in ("adapter_model.safetensors", "model.safetensors"):
        if (model_dir / name).exists():
            return load_file(model_dir / name)
    raise FileNotFoundError(model_dir)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)).item() for k in a)


def save_tiny_pretrained(out: Path, seed: int, dtype: torch.dtype = torch.float32, **config) -> Path:
    """A tiny llama saved as a HF model dir, with the byte tokenizer beside it.

    Every weight (norms included) is perturbed, so that a weight left at its init would show.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_LLAMA, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    shard = {"max_shard_size": "40KB"} if dtype != torch.float32 else {}
    model.to(dtype).save_pretrained(out, **shard)
    byte_tokenizer().save_pretrained(out)
    return out


def pretrained_model(path: Path) -> dict:
    """The recipe's ``model`` section for a saved tiny pretrained model."""
    return {"name_or_path": str(path), "dtype": "fp32", "attn_implementation": "eager"}


def run_sharded_load_probe(script: str, work: Path, variants: list[str], marker: str, timeout: int) -> dict:
    """The sharded-load probes (tests/distributed/*_meta_probe.py), one 2-rank launch: WORK/pretrained
    (fp32, one file) and WORK/tied (bf16, tied embeddings, an odd vocabulary, several files + index)
    recipes are written, ``script`` compares each variant; its JSON report (the ``marker`` line)."""
    plain = save_tiny_pretrained(work / "hf_plain", seed=1)
    tied = save_tiny_pretrained(
        work / "hf_tied", seed=2, dtype=torch.bfloat16, vocab_size=323, tie_word_embeddings=True
    )
    assert (tied / "model.safetensors.index.json").exists()
    write_recipe(work / "pretrained", model=pretrained_model(plain))
    write_recipe(work / "tied", model=pretrained_model(tied))
    cmd = [*torchrun_cmd(), str(ROOT / "tests/distributed" / script), str(work), *variants]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-6000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(f"{marker} "))
    return json.loads(line.split(" ", 1)[1])


# --- shared fixtures' material: one copy for the unit tests and their integration halves --------

# A tiny recipe for loading and resolving (tests/unit/test_recipe.py, the recipe fuzzing harness).
TINY_RECIPE = textwrap.dedent(
    """\
    run:
      output_dir: runs/t
    model:
      config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
               intermediate_size: 128, vocab_size: 320}
      dtype: fp32
    data:
      train: data/train.jsonl
      max_seq_len: 64
    batch:
      global_batch_size: 16
      micro_batch_size: 2
    optim:
      lr: 1e-4
    train:
      max_steps: 10
    """
)

# A tiny recipe the compiler resolves for every engine (compile, its command line, the registry).
COMPILE_RECIPE = textwrap.dedent(
    """\
    run: {output_dir: runs/compile-test}
    model:
      config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
               intermediate_size: 128, vocab_size: 320}
      dtype: fp32
    data: {train: data/never-opened.jsonl, max_seq_len: 64}
    batch: {global_batch_size: 32, micro_batch_size: 2}
    train: {max_steps: 10}
    """
)

# meta-llama/Llama-3.1-8B: its shape comes from plan.shape's table, nothing is downloaded.
LLAMA_8B_RECIPE = textwrap.dedent(
    """\
    model:
      name_or_path: meta-llama/Llama-3.1-8B
    data:
      train: train.jsonl
      max_seq_len: 2048
    batch:
      global_batch_size: 64
      micro_batch_size: 1
    train:
      max_steps: 10
    """
)


def write_text_recipe(tmp_path_factory, name: str, text: str) -> Path:
    """``text`` as ``recipe.yaml`` in a fresh temporary folder (for module-scoped fixtures)."""
    path = tmp_path_factory.mktemp(name) / "recipe.yaml"
    path.write_text(text)
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def default_recipe(train, objective: str = "sft", max_seq_len: int = 256, **data):
    """A default ``Recipe`` of ``train.objective`` reading ``train`` (a path, a source mapping, or a
    list of them), with data.* keys as kwargs."""
    from llmft.recipe.schema import Recipe

    r = Recipe()
    r.train.objective = objective
    as_str = lambda p: str(p) if isinstance(p, Path) else p  # noqa: E731
    r.data.train = [as_str(p) for p in train] if isinstance(train, list) else as_str(train)
    r.data.max_seq_len = max_seq_len
    for k, v in data.items():
        setattr(r.data, k, v)
    return r


def data_recipe(tmp_path: Path, train, **data):
    """A default ``Recipe`` reading ``train`` into a cache under ``tmp_path`` (data.* keys as kwargs)."""
    return default_recipe(train, cache_dir=str(tmp_path / "cache"), max_seq_len=data.pop("max_seq_len", 64), **data)


def rows(ds) -> list:
    """Every item of ``ds`` with its arrays as lists (items hold numpy arrays: comparable with ==)."""
    return [as_lists(ds[i]) for i in range(len(ds))]


def as_lists(item):
    """A dataset item (or any nesting of dicts, tuples and arrays) with every array as a list."""
    if isinstance(item, dict):
        return {k: as_lists(v) for k, v in item.items()}
    if isinstance(item, tuple | list):
        return type(item)(as_lists(v) for v in item)
    return item.tolist() if hasattr(item, "tolist") else item


def write_metrics(run_dir: Path, records: list) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# A metrics.jsonl of a run killed after step 4 and resumed from step 3 (steps 4 and 5 logged again).
PLOT_ROWS = [
    *({"split": "train", "step": s, "loss": 5.0 / s, "lr": 1e-3 * s / 4, "grad_norm": 1.0} for s in range(1, 5)),
    {"split": "eval", "step": 2, "loss": 3.0, "perplexity": 20.1, "tokens": 90, "exact_match": 0.0, "generated": 8},
    {"split": "train", "step": 4, "loss": 0.9, "lr": 1e-3, "grad_norm": 1.0},
    {"split": "train", "step": 5, "loss": 0.8, "lr": 1e-3, "grad_norm": 1.0},
    {"split": "eval", "step": 4, "loss": 1.0, "perplexity": 2.7, "exact_match": 0.5},
]


# --- reward models: texts to score, and transformers' own scoring of them ----------------------


def preference_texts(n: int = 6) -> list[str]:
    """prompt + chosen and prompt + rejected of ``n`` shipped demo pairs (data/preference)."""
    out = []
    for line in (ROOT / "data/preference/train.jsonl").read_text().splitlines()[100 : 100 + n]:
        pair = json.loads(line)
        out += [pair["prompt"] + pair["chosen"], pair["prompt"] + pair["rejected"]]
    return out


def reward_scores(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """transformers' own scoring: right-padded rows, the score at each row's last non-pad token."""
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()

"""The peer row of ``bench/gpu.py --quick``: what a user gets from the Hugging Face stack with the
QLoRA recipe, on the same model directory as llmft's qlora-8b row.

    python bench/peer_hf.py --model DIR --data records.jsonl --out DIR [--seq 4096 --steps 6]

Trainer + PEFT + bitsandbytes as their documentation sets QLoRA up: NF4 with double quantization
and bf16 compute (``BitsAndBytesConfig``), ``prepare_model_for_kbit_training`` (gradient
checkpointing, non-reentrant), LoRA r=16 / alpha 32 on every linear layer (``all-linear``), sdpa
attention, the Trainer's default AdamW, bf16, micro-batch 1 x accumulation 4, constant learning
rate 2e-4. Rows: the records' tokens (each record ends with eos) concatenated and cut into rows of
``--seq`` tokens, the way transformers' ``run_clm`` example packs them.

Writes ``<out>/metrics.jsonl`` in llmft's format (one train row per optimizer step: loss,
``tokens`` = targets of the step, ``tokens_per_s``, ``step_time_s``, ``peak_mem_gb`` from
``torch.cuda.max_memory_allocated``), so bench/gpu.py reads both sides the same way. A step's time
is from the end of the previous step to the end of this one (data, forward, backward, optimizer),
as llmft's loop measures it. ``--dtype fp32`` (``bench/gpu.sh --quick --check``, CPU) keeps the
recipe and computes in fp32.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

NEEDS = {
    "transformers": "pip install transformers",
    "peft": "pip install peft",
    "bitsandbytes": "pip install bitsandbytes",
    "accelerate": "pip install accelerate (the Trainer needs it)",
}


def missing_packages() -> list[str]:
    """``name (install command)`` for each package the peer needs and this environment lacks."""
    out = []
    for name, how in NEEDS.items():
        try:
            __import__(name)
        except Exception as e:  # an installed package that fails to import is as missing
            out.append(f"{name} ({how}; import failed: {type(e).__name__}: {e})")
    return out


def packed_rows(tokenizer, data: Path, seq: int, rows: int) -> list[list[int]]:
    """``rows`` rows of ``seq`` tokens: the records' ids, each ending with eos, concatenated and cut."""
    stream: list[int] = []
    for line in data.read_text().splitlines():
        stream += tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= seq * rows:
            break
    out = [stream[i * seq : (i + 1) * seq] for i in range(len(stream) // seq)][:rows]
    if len(out) < rows:
        raise SystemExit(f"peer: {data} holds {len(out)} rows of {seq} tokens, {rows} needed")
    return out


def load_qlora(model_dir: Path, dtype, cuda: bool):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )
    kwargs = {}
    # transformers >= 5.2x fetches hub kernels on CUDA unless told not to (nothing is downloaded here)
    if "use_kernels" in inspect.signature(PreTrainedModel.from_pretrained).parameters:
        kwargs["use_kernels"] = False
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        quantization_config=quant,
        dtype=dtype,
        attn_implementation="sdpa",
        device_map={"": torch.cuda.current_device()} if cuda else None,
        **kwargs,
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args()
    missing = missing_packages()
    if missing:
        print("peer: cannot run, missing: " + "; ".join(missing), file=sys.stderr)
        return 3

    import torch
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    micro, accumulation = 1, 4
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = packed_rows(tokenizer, args.data, args.seq, args.steps * micro * accumulation)
    dataset = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]
    model = load_qlora(args.model, dtype, cuda)

    args.out.mkdir(parents=True, exist_ok=True)
    metrics = args.out / "metrics.jsonl"
    metrics.write_text("")
    targets = micro * accumulation * (args.seq - 1)  # the shifted labels of the step's rows

    class Timing(TrainerCallback):
        last = 0.0
        losses: dict[int, float] = {}

        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()

        def on_log(self, a, state, control, logs=None, **k):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

        def on_step_end(self, a, state, control, **k):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            dt, self.last = now - self.last, now
            row = {"split": "train", "step": state.global_step, "tokens": targets, "step_time_s": dt}
            row["tokens_per_s"] = targets / dt
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            with open(metrics, "a") as f:
                f.write(json.dumps(row) + "\n")

    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        max_steps=args.steps,
        learning_rate=2e-4,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        bf16=args.dtype == "bf16",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=0,
        use_cpu=not cuda,
        disable_tqdm=True,
    )
    timing = Timing()
    Trainer(model=model, args=training, train_dataset=dataset, callbacks=[timing]).train()
    # the losses reach the callback after the step rows: add them to the rows written
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    for row in lines:
        row["loss"] = timing.losses.get(row["step"])
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    print(f"peer: {args.steps} steps, optimizer {training.optim}, transformers Trainer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

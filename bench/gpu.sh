#!/usr/bin/env bash
# GPU benchmark on one GPU, nothing downloaded: randomly initialised models with the shapes of
# meta-llama/Llama-3.1-8B and meta-llama/Llama-3.2-1B (taken from llmft/plan/shape.py KNOWN),
# llmft's built-in byte tokenizer, synthetic text generated here, bf16, gradient checkpointing.
#
#   qlora-8b   QLoRA (NF4 + double quant, LoRA r=16 all-linear, paged 8-bit AdamW) on the 8B shape:
#              configs/llama3-8b-qlora-1gpu.yaml with the model swapped for model.config
#   full-1b    full fine-tune (AdamW, fp32 master weights) of the 1B shape:
#              configs/tiny-cpu.yaml with the 1B shape, bf16 and a GPU-sized batch
#
# Each runs `llmft train` for $STEPS optimizer steps (packed rows of $SEQ tokens) and the table
# reads metrics.jsonl: median tokens/s and MFU of the steps after the first $WARMUP, the largest
# peak_mem_gb (torch.cuda.max_memory_allocated), beside `llmft plan`'s estimate.
#
#   bash bench/gpu.sh                 # both cases; writes $OUT_DIR/gpu.md (default runs/bench-gpu)
#   bash bench/gpu.sh --check         # no GPU needed: `llmft compile` both recipes and exit
#   CASES="full-1b" STEPS=20 bash bench/gpu.sh
#
# Set-up time before the first step: the 8B case builds the random bf16 model on the CPU
# (~16 GB of RAM), writes it once to a temporary directory (~16 GB of disk) and loads it back
# quantized, as llmft does for any model.config + quantization recipe: a few minutes.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-runs/bench-gpu}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-5}
SEQ=${SEQ:-2048}
CASES=${CASES:-"qlora-8b full-1b"}
CHECK=0
if [[ "${1:-}" == "--check" ]]; then
    CHECK=1
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT_DIR"
DATA="$OUT_DIR/synthetic.jsonl"

# model.config override (one OmegaConf dot-list value) for a KNOWN hub shape.
model_config() {
    "$PYTHON" - "$1" <<'EOF'
import sys
from llmft.plan.shape import KNOWN
fields = {"model_type": "llama", **KNOWN[sys.argv[1]], "max_position_embeddings": 8192, "rope_theta": 500000.0}
print("model.config={" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()) + "}")
EOF
}

# ~2.5 M tokens of lowercase words with lognormal record lengths (the byte tokenizer: 1 byte = 1 token).
make_data() {
    "$PYTHON" - "$DATA" <<'EOF'
import json, math, random, string, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    total = 0
    while total < 2_500_000:
        n = max(16, min(6000, round(rng.lognormvariate(math.log(600), 0.8))))
        words = []
        while sum(map(len, words)) + len(words) < n:
            words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))))
        text = " ".join(words)[:n]
        f.write(json.dumps({"text": text}) + "\n")
        total += len(text)
EOF
}

COMMON=(
    "data.train=$DATA" "data.eval=null" "data.eval_fraction=0" "data.packing=true" "data.train_on=all"
    "data.max_seq_len=$SEQ" "data.num_workers=2"
    "model.dtype=bf16" "model.gradient_checkpointing=true" "model.attn_implementation=sdpa"
    "train.max_steps=$STEPS" "train.log_every_steps=1" "train.eval_every_steps=null" "train.progress_bar=false"
    "checkpoint.every_steps=null" "checkpoint.resume=never" "checkpoint.save_optimizer=false"
    "run.overwrite=true" "run.tensorboard=false" "distributed.engine=single"
    "distributed.nproc_per_node=1" "distributed.nnodes=1"
)

case_recipe() {
    case "$1" in
        qlora-8b) echo "configs/llama3-8b-qlora-1gpu.yaml" ;;
        full-1b) echo "configs/tiny-cpu.yaml" ;;
        *) echo "unknown case $1" >&2; exit 2 ;;
    esac
}

case_overrides() {
    case "$1" in
        qlora-8b)
            echo "model.name_or_path=null"
            model_config meta-llama/Llama-3.1-8B
            printf '%s\n' "batch.global_batch_size=4" "batch.micro_batch_size=2" \
                "batch.gradient_accumulation_steps=auto" "optim.warmup_steps=0" "distributed.gpu_memory_gb=null"
            ;;
        full-1b)
            model_config meta-llama/Llama-3.2-1B
            printf '%s\n' "batch.global_batch_size=8" "batch.micro_batch_size=8" \
                "batch.gradient_accumulation_steps=auto" "optim.name=adamw" "optim.lr=1.0e-4" \
                "optim.warmup_steps=0" "optim.scheduler=constant" "data.shuffle=true"
            ;;
    esac
}

for name in $CASES; do
    recipe=$(case_recipe "$name")
    mapfile -t extra < <(case_overrides "$name")
    args=("$recipe" "${COMMON[@]}" "${extra[@]}" "run.output_dir=$OUT_DIR/$name")
    if [[ $CHECK == 1 ]]; then
        touch "$DATA"  # compile checks that data.train exists; it reads nothing
        "$PYTHON" -m llmft compile "${args[@]}" --out "$OUT_DIR/$name/compiled"
        continue
    fi
    [[ -s "$DATA" ]] || make_data
    echo "== $name: $PYTHON -m llmft train ${args[*]}" >&2
    "$PYTHON" -m llmft train "${args[@]}" 2>&1 | tee "$OUT_DIR/$name.log" >&2
done
[[ $CHECK == 1 ]] && exit 0

"$PYTHON" - "$OUT_DIR" "$WARMUP" "$SEQ" $CASES <<'EOF' | tee "$OUT_DIR/gpu.md"
import json, statistics, sys
from pathlib import Path
from llmft.plan.memory import CUDA_CONTEXT_BYTES, GIB, estimate_memory
from llmft.plan.resolve import load_plan

out, warmup, seq, cases = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
import torch
print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; max_seq_len {seq}, packed; "
      f"medians over steps after the first {warmup}\n")
print("| case | tokens/s | MFU | peak_mem_gb (allocated) | estimate GiB (llmft plan, no CUDA context) | steps |")
print("| --- | --- | --- | --- | --- | --- |")
for name in cases:
    run = out / name
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train":
            rows[row["step"]] = row
    steady = [rows[k] for k in sorted(rows)][warmup:]
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    mfu = f"{statistics.median(mfus):.1%}" if mfus else "n/a (GPU not in llmft/flops.py)"
    peak = max(r.get("peak_mem_gb") or 0.0 for r in steady)
    est = estimate_memory(load_plan(str(run / "recipe.yaml"), [], world_size=1))
    print(f"| {name} | {tps:,.0f} | {mfu} | {peak:.1f} | {(est.total - CUDA_CONTEXT_BYTES) / GIB:.1f} | {len(rows)} |")
EOF

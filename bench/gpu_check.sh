#!/usr/bin/env bash
# The prepared GPU check, one command on a machine with one CUDA GPU: the quick bench (qlora-8b and
# full-1b, all on and compile off, and the Hugging Face Trainer + PEFT + bitsandbytes peer row), then
# the GPU tests. Everything it measures goes under $OUT (default runs/gpu-check):
#
#   bash bench/gpu_check.sh              # both parts: bench (<= 8 min) then tests
#   bash bench/gpu_check.sh bench        # only bench/gpu.sh --quick  -> $OUT/gpu.md, logs, metrics
#   bash bench/gpu_check.sh tests        # only pytest -m gpu tests/gpu -> $OUT/pytest.txt, $OUT/junit.xml
#   WHEELS=/path/to/wheels bash bench/gpu_check.sh   # first installs what is missing from a wheel
#                                                    # directory, offline (docs/offline.md builds one)
#
# The bench's models (~18 GB) and runs stay in $BENCH_OUT (default runs/bench-gpu); $OUT gets its
# table, logs, metrics.jsonl and timing files (small). $OUT also gets versions.txt (python, torch, CUDA, every package the check uses) and nvidia-smi.txt.
# A package llmft needs and the machine lacks is named, with the install command, before anything runs.
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${OUT:-runs/gpu-check}"
PARTS="${1:-all}"
mkdir -p "$OUT"
OUT_ABS="$(cd "$OUT" && pwd)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

NEEDED="torch transformers peft accelerate omegaconf datasets safetensors yaml deepspeed bitsandbytes pytest"
missing() {  # the import names that fail (imports may print their own warnings: only our line counts)
    "$PY" - "$@" 2>/dev/null <<'EOF'
import importlib, sys
gone = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        gone.append(name)
print("MISSING:" + " ".join(gone))
EOF
}

gone="$(missing $NEEDED | sed -n 's/^MISSING://p')"
if [ -n "$gone" ] && [ -n "${WHEELS:-}" ]; then
    pkgs="$(echo "$gone" | sed 's/\byaml\b/pyyaml/')"
    echo "gpu_check: installing from $WHEELS (offline): $pkgs"
    "$PY" -m pip install --no-index --find-links "$WHEELS" $pkgs || true
    gone="$(missing $NEEDED | sed -n 's/^MISSING://p')"
fi
if [ -n "$gone" ]; then
    echo "gpu_check: missing Python packages: $gone" >&2
    echo "  install them with: pip install -e '.[dev]' (online), or WHEELS=<wheel dir> bash bench/gpu_check.sh (offline)" >&2
    exit 2
fi

{
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for pkg in ("transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "liger-kernel", "flash-attn", "triton", "kernels"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "not installed")
EOF
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

status=0
if [ "$PARTS" = all ] || [ "$PARTS" = bench ]; then
    # --quick is sized for <= 8 minutes on one H100/H200; the limit keeps a slow machine's table
    bench="${BENCH_OUT:-runs/bench-gpu}"
    timeout "${BENCH_TIMEOUT_S:-540}" bash bench/gpu.sh --quick --out "$bench" 2>&1 | tee "$OUT/bench.log"
    status=$((status | ${PIPESTATUS[0]}))
    # the table (rewritten after every run, so a cut-off bench keeps what finished) and the small files
    [ -d "$bench" ] && (cd "$bench" && find . -maxdepth 3 \( -name gpu.md -o -name '*.log' -o -name '*.yaml' -o -name '*.phases.json' \
        -o -name metrics.jsonl \) -size -5M -print0 | xargs -0 -r cp --parents -t "$OUT_ABS")
    cp "$bench/gpu.md" "$OUT/gpu.md" 2>/dev/null || true
fi
if [ "$PARTS" = all ] || [ "$PARTS" = tests ]; then
    timeout "${TESTS_TIMEOUT_S:-540}" "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs \
        --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.txt"
    status=$((status | ${PIPESTATUS[0]}))
fi
exit "$status"

#!/usr/bin/env bash
# One-call GPU check for one H100/H200 (about 9 minutes): the GPU tests, then `mimir bench` on the
# Mimir shape at k=5 and k=8 in several variants next to the transformers hrm_text peer.
#
#   WHEELS=.whl bash bench/gpu_check.sh [RESULTS_DIR]
#
# RESULTS_DIR defaults to $OUT when set, else bench/results/<date-time>. It receives at most seven
# files: env.txt, tests.log, bench_k5.{json,log}, bench_k8.{json,log}, summary.md.
#
# Needs only a preinstalled PyTorch (>= 2.6 with Triton). Missing Python packages come from the
# wheel folder WHEELS (made by bench/fetch_wheels.sh where PyPI is reachable) and are installed
# into a scratch folder; nothing is installed into the system. The package itself is used from
# this checkout. Transformer Engine variants (TE bf16, FP8 recipes) run only where TE imports
# (NVIDIA's PyTorch containers); elsewhere the best path without it is measured (bf16 with
# FlexAttention, SDPA or torch's varlen flash attention).
#
# Knobs (environment): BUDGET_S (total seconds, default 540), MICRO_BATCH (default 4) and SEQ_LEN
# (default 4096): 16,384 tokens per step, STEPS (timed steps, default 4), SHAPE (mimir; `tiny`
# for a dry run of this script on a CPU), PYTHON (default python3).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-${OUT:-$repo/bench/results/$(date +%Y%m%d-%H%M%S)}}
python=${PYTHON:-python3}
budget=${BUDGET_S:-540}
micro_batch=${MICRO_BATCH:-4}
seq_len=${SEQ_LEN:-4096}
shape=${SHAPE:-mimir}
steps=${STEPS:-4}
started=$SECONDS
mkdir -p "$out"

left() { echo $((budget - (SECONDS - started))); }

# The package from this checkout, without installing it: its three import names as links.
site=$(mktemp -d /tmp/mimir-gpu-check.XXXXXX)
ln -s "$repo/mimir_megatron" "$site/mimir_megatron"
ln -s "$repo/kernels" "$site/mimir_kernels"
ln -s "$repo/data_prep" "$site/mimir_data_prep"
if [[ -n "${WHEELS:-}" ]]; then
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site/deps" "$WHEELS"/*.whl || { echo "cannot install wheels from $WHEELS" >&2; exit 1; }
fi
export PYTHONPATH="$site:$site/deps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    "$python" - <<'PY' 2>&1
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
for name in ("triton", "megatron.core", "omegaconf", "transformers", "transformer_engine", "flash_attn"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "absent:", type(exc).__name__, str(exc).splitlines()[0][:120] if str(exc) else "")
PY
} >"$out/env.txt"
cat "$out/env.txt"
have_te=0
grep -q "^transformer_engine [0-9]" "$out/env.txt" && have_te=1

# 1. GPU tests: the tests marked `gpu` (CUDA kernels vs the CPU reference, TE vs local layers,
#    bf16 training on the GPU). Only their files are collected: the rest of the suite needs
#    packages (mlflow, Slurm) that a bare GPU image lacks.
timeout --signal=INT 200 "$python" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    "$repo/tests/test_attention_backends.py" "$repo/tests/test_gpu.py" >"$out/tests.log" 2>&1
echo "GPU tests: exit $? (log: tests.log)"
tail -n 3 "$out/tests.log"

# 2. Benchmarks. Every variant shares the Mimir preset's chunked loss; contexts are one sample
#    each so that the transformers peer can run the same batch.
variants_k5=(
    "dense+recompute:attention_backend=dense,recompute=full"
    "flex+recompute:attention_backend=flex,recompute=full"
    "flex+recompute+compile:attention_backend=flex,recompute=full,compile=true"
    "varlen+recompute:attention_backend=varlen,recompute=full"
    "flex:attention_backend=flex"
)
variants_k8=(
    "flex+recompute:attention_backend=flex,recompute=full"
    "flex+recompute+compile:attention_backend=flex,recompute=full,compile=true"
)
if ((have_te)); then
    variants_k5+=(
        "te+flex+recompute:layer_backend=te,attention_backend=flex,recompute=full"
        "te-fp8-current:layer_backend=te,attention_backend=flex,recompute=full,fp8=current"
        "te-fp8-delayed:layer_backend=te,attention_backend=flex,recompute=full,fp8=delayed"
    )
    variants_k8+=("te-fp8-current:layer_backend=te,attention_backend=flex,recompute=full,fp8=current")
fi

run_bench() {  # window, seconds, variants...
    local k=$1 seconds=$2
    shift 2
    local args=()
    for v in "$@"; do args+=(--variant "$v"); done
    timeout --signal=INT "$seconds" "$python" -m mimir_megatron.cli bench --shape "$shape" \
        --window "$k" --seq-len "$seq_len" --micro-batch "$micro_batch" --steps "$steps" --warmup 2 \
        --json "$out/bench_k$k.json" "${args[@]}" loss_chunk_tokens=2048 >"$out/bench_k$k.log" 2>&1
    echo "bench k=$k: exit $? (log: bench_k$k.log)"
}
k5_time=$(( $(left) * 3 / 5 ))
run_bench 5 "$k5_time" "${variants_k5[@]}"
run_bench 8 "$(( $(left) - 10 ))" "${variants_k8[@]}"

{
    echo "# GPU check $(date -u +%Y-%m-%d)"
    echo
    echo '```'
    cat "$out/env.txt"
    echo '```'
    echo
    echo "## Tests"
    echo '```'
    tail -n 15 "$out/tests.log"
    echo '```'
    for k in 5 8; do
        echo
        echo "## Bench $shape k=$k (micro-batch $micro_batch x $seq_len tokens)"
        echo '```'
        grep -v -E "^(W|I)[0-9]{4} " "$out/bench_k$k.log" | tail -n 25
        echo '```'
    done
    echo
    echo "total: $((SECONDS - started)) s"
} >"$out/summary.md"
echo "results in $out ($((SECONDS - started)) s)"
rm -rf "$site"

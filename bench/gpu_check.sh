#!/usr/bin/env bash
# One-call GPU check for one H100/H200 (about 9 minutes): the GPU tests, then `mimir bench` on the
# Mimir shape at k=5 and k=8 in several variants next to the transformers hrm_text peer.
#
#   WHEELS=.whl bash bench/gpu_check.sh [RESULTS_DIR]
#
# RESULTS_DIR defaults to $OUT when set, else bench/results/<date-time>. It receives seven files:
# env.txt, tests.log, bench.log, bench_k5_packed.json, bench_k5.json, bench_k8.json, summary.md.
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

# 2. Benchmarks, three runs. Every variant shares the Mimir preset's chunked loss.
#    a) k=5 on packed contexts (8 samples each, like real SFT data): the attention kernels and
#       levers against each other; the peer cannot express packing, so it sits this one out.
#    b) k=5 and c) k=8 on one sample per context, next to the transformers peer.
packed_variants=(
    "dense+recompute:attention_backend=dense,recompute=full"
    "flex+recompute:attention_backend=flex,recompute=full"
    "flex+recompute+compile:attention_backend=flex,recompute=full,compile=true"
    "varlen+recompute:attention_backend=varlen,recompute=full"
    "flex:attention_backend=flex"
)
peer_variants=(
    "flex+recompute:attention_backend=flex,recompute=full"
    "flex+recompute+compile:attention_backend=flex,recompute=full,compile=true"
)
if ((have_te)); then
    packed_variants+=(
        "te+flex+recompute:layer_backend=te,attention_backend=flex,recompute=full"
        "te-fp8-current:layer_backend=te,attention_backend=flex,recompute=full,fp8=current"
        "te-fp8-delayed:layer_backend=te,attention_backend=flex,recompute=full,fp8=delayed"
    )
    peer_variants+=("te-fp8-current:layer_backend=te,attention_backend=flex,recompute=full,fp8=current")
fi

: >"$out/bench.log"
run_bench() {  # name, window, seconds, extra bench arguments (--variant ..., --no-peer, ...)
    local name=$1 k=$2 seconds=$3
    shift 3
    echo "== $name: k=$k, micro-batch $micro_batch x $seq_len tokens $*" >>"$out/bench.log"
    timeout --signal=INT "$seconds" "$python" -m mimir_megatron.cli bench --shape "$shape" \
        --window "$k" --seq-len "$seq_len" --micro-batch "$micro_batch" --steps "$steps" --warmup 2 \
        --json "$out/$name.json" "$@" loss_chunk_tokens=2048 >>"$out/bench.log" 2>&1
    echo "bench $name: exit $?"
}
variant_args() { local v; for v in "$@"; do printf -- '--variant\n%s\n' "$v"; done; }
mapfile -t packed_args < <(variant_args "${packed_variants[@]}")
mapfile -t peer_args < <(variant_args "${peer_variants[@]}")
run_bench bench_k5_packed 5 "$(( $(left) * 9 / 20 ))" --no-peer --samples-per-context 8 "${packed_args[@]}"
run_bench bench_k5 5 "$(( $(left) * 9 / 20 ))" "${peer_args[@]}"
run_bench bench_k8 8 "$(( $(left) - 10 ))" "${peer_args[@]}"

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
    echo
    echo "## Bench ($shape)"
    echo '```'
    grep -v -E "^[WI][0-9]{4} |[Ww]arn|Loading weights| INFO | ERROR |^[[:space:]]" "$out/bench.log"
    echo '```'
    echo
    echo "total: $((SECONDS - started)) s"
} >"$out/summary.md"
echo "results in $out ($((SECONDS - started)) s)"
rm -rf "$site"

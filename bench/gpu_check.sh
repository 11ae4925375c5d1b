#!/usr/bin/env bash
# One-call GPU check for one H100/H200 (nine minutes by default): the GPU tests, then `mimir bench`
# on the Mimir shape at k=5 and k=8 next to the transformers hrm_text peer, then the attention
# kernels against each other on packed contexts. Every bench row of ours sets its measured peak
# memory beside `mimir plan`'s for the same step (peak GB, plan GB; GB = 1e9 bytes), and the GPU
# tests count what compiled FlexAttention keeps against the plan (tests/unit/test_saved_activations.py).
#
#   WHEELS=.whl bash bench/gpu_check.sh [RESULTS_DIR]
#
# RESULTS_DIR defaults to $OUT when set, else bench/results/<date-time>. It receives six files:
# env.txt, tests.log, bench.log, bench_k5_k8.json, bench_k5_packed.json, summary.md. summary.md
# is rewritten after every part, so a call cut short still brings back what it measured.
#
# Needs only a preinstalled PyTorch (>= 2.6 with Triton). Missing Python packages come from the
# wheel folder WHEELS (made by bench/fetch_wheels.sh where PyPI is reachable) and are installed
# into a scratch folder; nothing is installed into the system. The package itself is used from
# this checkout. Transformer Engine variants (TE bf16, FP8 recipes) run only where TE imports
# (NVIDIA's PyTorch containers); elsewhere the best path without it is measured (bf16 with
# FlexAttention, SDPA or torch's varlen flash attention).
#
# Time: every part runs under `timeout` with a limit taken from what is left of BUDGET_S, and
# `-k`: a process that ignores the interrupt (a CUDA or NCCL teardown that hangs) is killed
# KILL_AFTER_S later, so the script always reaches its summary. A part with under MIN_PART_S
# left is skipped, never started with a zero limit (`timeout 0` would mean no limit). Inside a
# bench process the cheap variants run first, the peer right after the first, compile last.
#
# Knobs (environment): BUDGET_S (total seconds, default 540), MICRO_BATCH (default 4) and SEQ_LEN
# (default 4096): 16,384 tokens per step, STEPS (timed steps, default 4), SHAPE (mimir; `tiny`
# for a dry run of this script on a CPU), PYTHON (default python3), TEST_TIMEOUT_S (one test's
# limit, default 90), KILL_AFTER_S (default 15), MIN_PART_S (default 30).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-${OUT:-$repo/bench/results/$(date +%Y%m%d-%H%M%S)}}
python=${PYTHON:-python3}
budget=${BUDGET_S:-540}
micro_batch=${MICRO_BATCH:-4}
seq_len=${SEQ_LEN:-4096}
shape=${SHAPE:-mimir}
steps=${STEPS:-4}
test_timeout=${TEST_TIMEOUT_S:-90}
kill_after=${KILL_AFTER_S:-15}
min_part=${MIN_PART_S:-30}
started=$SECONDS
mkdir -p "$out"

# Seconds left for parts: the budget less the time spent, a possible kill, and the summary.
left() { echo $((budget - (SECONDS - started) - kill_after - 5)); }
# A part's limit: PERCENT of what is left, at most CAP seconds (0: no cap).
part_limit() {
    local percent=$1 cap=$2 seconds
    seconds=$(($(left) * percent / 100))
    if ((cap > 0 && seconds > cap)); then seconds=$cap; fi
    echo "$seconds"
}
# Run a command under a clamped limit; exit status 124 (timed out), 137 (killed), or the skip
# status 125 when the limit is under MIN_PART_S.
limited() {
    local seconds=$1
    shift
    if ((seconds < min_part)); then
        echo "skipped: ${seconds} s left, under MIN_PART_S=${min_part}"
        return 125
    fi
    timeout -k "$kill_after" --signal=INT "$seconds" "$@"
}
status_word() {
    case $1 in
        0) echo "ok" ;;
        124) echo "timed out (interrupted)" ;;
        137) echo "killed ${kill_after} s after the interrupt" ;;
        125) echo "skipped (budget)" ;;
        *) echo "exit $1" ;;
    esac
}

# The package from this checkout, without installing it: its three import names as links.
site=$(mktemp -d /tmp/mimir-gpu-check.XXXXXX)
trap 'rm -rf "$site"' EXIT
ln -s "$repo/mimir_megatron" "$site/mimir_megatron"
ln -s "$repo/kernels/mimir_kernels" "$site/mimir_kernels"
ln -s "$repo/data_prep/mimir_data_prep" "$site/mimir_data_prep"
if [[ -n "${WHEELS:-}" ]]; then
    "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site/deps" "$WHEELS"/*.whl || { echo "cannot install wheels from $WHEELS" >&2; exit 1; }
fi
export PYTHONPATH="$site:$site/deps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    else
        echo "nvidia-smi: absent"
    fi
    "$python" - <<'PY' 2>&1
import importlib, logging, warnings
warnings.filterwarnings("ignore")  # megatron's import-time notes about TE and apex
logging.disable(logging.WARNING)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
for name in ("triton", "megatron.core", "omegaconf", "transformers", "transformer_engine", "flash_attn",
             "pytest_timeout"):
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
per_test=()
grep -q "^pytest_timeout " "$out/env.txt" && per_test=(--timeout "$test_timeout")

: >"$out/tests.log"
: >"$out/bench.log"
parts=()
write_summary() {
    {
        echo "# GPU check $(date -u +%Y-%m-%d)"
        echo
        echo '```'
        cat "$out/env.txt"
        echo '```'
        echo
        echo "## Parts"
        echo
        printf -- '- %s\n' "${parts[@]}"
        echo
        echo "## Tests (failures, skips with their reasons, durations slowest first)"
        echo '```'
        grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|skipped|Timeout|^[0-9.]+s (call|setup)" "$out/tests.log" |
            tail -n 50
        echo '```'
        echo
        echo "## Bench ($shape, micro-batch $micro_batch x $seq_len tokens)"
        echo
        echo "The peer runs with gradient checkpointing, our variants with execution.recompute=full (like with"
        echo "like: neither fits 4 x 4096 tokens at the Mimir shape without); peak GB is per row, plan GB is"
        echo "mimir plan's peak for the same step: a peak more than 10 % above it is a finding (docs/planning.md)."
        echo '```'
        grep -v -E "^[WI][0-9]{4} |[Ww]arn|Loading weights| INFO | ERROR |^[[:space:]]" "$out/bench.log"
        echo '```'
        echo
        echo "total: $((SECONDS - started)) s of BUDGET_S=$budget"
    } >"$out/summary.md"
}

# 1. GPU tests: the tests marked `gpu` (CUDA kernels vs the CPU reference, TE vs local layers,
#    bf16 training on the GPU). Only their files are collected: the rest of the suite needs
#    packages (mlflow, Slurm) that a bare GPU image lacks.
seconds=$(part_limit 30 150)
limited "$seconds" "$python" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs --durations=0 \
    "${per_test[@]}" "$repo/tests/unit/test_attention_backends.py" "$repo/tests/unit/test_gpu.py" \
    "$repo/tests/unit/test_saved_activations.py" >"$out/tests.log" 2>&1
code=$?
parts+=("GPU tests: $(status_word "$code") (limit ${seconds} s, ${test_timeout} s per test), at $((SECONDS - started)) s")
echo "${parts[-1]}"
tail -n 3 "$out/tests.log"
write_summary

# 2. Benchmarks, two processes; every variant shares the Mimir preset's chunked loss (2,048
#    tokens) unless it names its own.
#    a) k=5 and k=8 on one sample per context, next to the peer (which cannot express packing):
#       the kernels with recompute, the peak memory without the chunked loss, compile last.
#    b) k=5 on packed contexts (8 samples each, like real SFT data): the kernels against each
#       other where the block sparsity matters.
peer_variants=(
    "dense+recompute:execution.attention_backend=dense,execution.recompute=full"
    "varlen+recompute:execution.attention_backend=varlen,execution.recompute=full"
    "flex+recompute:execution.attention_backend=flex,execution.recompute=full"
    "flex+recompute+full-logits:execution.attention_backend=flex,execution.recompute=full,execution.loss_chunk_tokens=0"
)
packed_variants=(
    "dense+recompute:execution.attention_backend=dense,execution.recompute=full"
    "varlen+recompute:execution.attention_backend=varlen,execution.recompute=full"
    "flex+recompute:execution.attention_backend=flex,execution.recompute=full"
)
if ((have_te)); then
    peer_variants+=("te-fp8-current:execution.layer_backend=te,execution.attention_backend=flex,execution.recompute=full,execution.fp8=current")
    packed_variants+=(
        "te+flex+recompute:execution.layer_backend=te,execution.attention_backend=flex,execution.recompute=full"
        "te-fp8-current:execution.layer_backend=te,execution.attention_backend=flex,execution.recompute=full,execution.fp8=current"
        "te-fp8-delayed:execution.layer_backend=te,execution.attention_backend=flex,execution.recompute=full,execution.fp8=delayed"
    )
fi
peer_variants+=("flex+recompute+compile:execution.attention_backend=flex,execution.recompute=full,execution.compile=true")
packed_variants+=("flex+recompute+compile:execution.attention_backend=flex,execution.recompute=full,execution.compile=true")

run_bench() {  # name, windows, limit (s), extra bench arguments (--variant ..., --no-peer, ...)
    local name=$1 windows=$2 seconds=$3 code
    shift 3
    echo "== $name: k=$windows, micro-batch $micro_batch x $seq_len tokens, limit ${seconds} s $*" >>"$out/bench.log"
    limited "$seconds" "$python" -m mimir_megatron.cli bench --shape "$shape" \
        --window "$windows" --seq-len "$seq_len" --micro-batch "$micro_batch" --steps "$steps" --warmup 1 \
        --json "$out/$name.json" "$@" execution.loss_chunk_tokens=2048 >>"$out/bench.log" 2>&1
    code=$?
    parts+=("bench $name: $(status_word "$code") (limit ${seconds} s), at $((SECONDS - started)) s")
    echo "${parts[-1]}"
    write_summary
}
variant_args() { local v; for v in "$@"; do printf -- '--variant\n%s\n' "$v"; done; }
mapfile -t peer_args < <(variant_args "${peer_variants[@]}")
mapfile -t packed_args < <(variant_args "${packed_variants[@]}")
run_bench bench_k5_k8 5,8 "$(part_limit 60 0)" --peer-checkpointing "${peer_args[@]}"
run_bench bench_k5_packed 5 "$(part_limit 100 0)" --no-peer --samples-per-context 8 "${packed_args[@]}"

echo "results in $out ($((SECONDS - started)) s)"

#!/usr/bin/env bash
# The CPU demo, end to end: bash launchers/demo_cpu.sh
#
# Sets up .venv (Python 3.12), generates and prepares the bilingual demo data, trains the tiny
# HRM-Text on 2 CPU cores (< 10 minutes), evaluates exact match on the held-out split, exports the
# model with its model card and training-data summary, and says where the MLflow run is. Rerunning resumes (or, when finished, only re-evaluates).
# Environment: RUN_DIR (default runs/demo), OMP_NUM_THREADS (default 2, which README.md's
# numbers need); extra key=value overrides as arguments, e.g.
# bash launchers/demo_cpu.sh train.steps=100. The data goes to data/demo, where
# configs/data/demo.yaml expects it.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
run_dir="${RUN_DIR:-runs/demo}"
# torch's CPU results depend on its thread count (a matmul's reduction order follows its
# threads): README.md's numbers are those of 2 threads, so the demo uses 2 on any machine.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
data_dir="data/demo"

bash launchers/setup_env.sh demo
mimir="${VENV:-$repo/.venv}/bin/mimir"

# Kept when this version's recipe built it; built again otherwise (an older version's demo data).
"$mimir" data demo --output "$data_dir" --reuse
"$mimir" train --config configs/train/demo.yaml "run.dir=$run_dir" "data.eval_path=$data_dir/eval" "$@"
# The release artefacts: transformers weights, a model card and the training-data summary, every
# figure from the checkpoint's data lineage (docs/data-governance.md).
"$mimir" export --checkpoint "$run_dir" --output "$run_dir/export" --name mimir-demo --license Apache-2.0 \
    --provider "mimir-megatron demo" >/dev/null

echo
echo "Model card:       $run_dir/export/README.md (training data: $run_dir/export/training_data_summary.md)"
echo "MLflow run store: $run_dir/mlflow.db (experiment mimir-demo)"
echo "Browse it:        $mimir ui --run-dir $run_dir    # then open http://127.0.0.1:5000 (it prints its login)"

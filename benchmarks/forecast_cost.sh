#!/usr/bin/env bash
# The forecast's cost against FP32 fine-tunes of the same flags (docs/forecast.md, "Cost"; docs/results/forecast.md), under the same
# load: `numscope forecast` beside FINETUNES FP32 fine-tunes run one after another, so that neither process
# runs alone on a 2-core machine; one thread each; each its own data cache; every process under
# /usr/bin/time -v (wall, CPU, peak RSS in OUT/*.time). FINETUNES=1 is the side-by-side measurement.
#
# Run: benchmarks/forecast_cost.sh MODEL_DIR TEXT OUT [FINETUNES (default 3)]
#   e.g. benchmarks/forecast_cost.sh /tmp/mpnet/all-mpnet-base-v2 /tmp/wiki.txt /tmp/cost 3
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 MODEL_DIR TEXT OUT [FINETUNES]" >&2
    exit 2
fi
MODEL=$1 TEXT=$2 OUT=$3 FINETUNES=${4:-3}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
FLAGS=(--model "$MODEL" --text "$TEXT" --seq-len 128 --batch-size 4 --steps 100 --lr 1e-4 --warmup-steps 10
    --eval-every 50 --no-progress)
mkdir -p "$OUT"
(
    for k in $(seq 1 "$FINETUNES"); do
        /usr/bin/time -v -o "$OUT/train$k.time" numscope train "${FLAGS[@]}" --plan fp32 \
            --cache "$OUT/cache-train" --out "$OUT/fp32-$k" > "$OUT/train$k.out" 2> "$OUT/train$k.err"
    done
) &
/usr/bin/time -v -o "$OUT/forecast.time" numscope forecast "${FLAGS[@]}" --stacks te \
    --cache "$OUT/cache-forecast" --out "$OUT/forecast" > "$OUT/forecast.out" 2> "$OUT/forecast.err"
wait
grep -H -E "Elapsed|User time|System time|Maximum resident" "$OUT"/*.time

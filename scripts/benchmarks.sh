#!/usr/bin/env bash
# Rerun every benchmark whose figures docs/performance.md quotes, one after another, and keep
# each one's output with the command, the commit and the machine it ran on:
#   bash scripts/benchmarks.sh [NAME ...]       # default: all; results in benchmarks/results/
# Needs the shared models and data ($BREWNET_SHARED, default ../shared). Takes an hour or more;
# run it on an otherwise idle machine, or note the load it reports.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A CMD=(
  [small_nets]="python benchmarks/small_nets.py"
  [inference]="python benchmarks/inference.py"
  [step_graph]="python benchmarks/step_graph.py"
  [data]="python benchmarks/data.py"
  [many_nets]="python benchmarks/many_nets.py --ks 8"
  [fused]="python benchmarks/fused.py"
  [thread_bits]="python benchmarks/thread_bits.py"
  [conv_wgrad]="python benchmarks/conv_wgrad.py --rounds 7"
  [max_pool]="python benchmarks/max_pool.py --threads 1"
  [train_speed]="python benchmarks/train_speed.py --iterations 10 --rounds 5"
  [scaling]="python benchmarks/scaling.py"
  [serve]="python benchmarks/serve.py lenet --body jpeg,npy --breakdown"
  [zoo]="python benchmarks/zoo.py --json benchmarks/results/zoo.json"
  [bf16]="python benchmarks/bf16.py"
  [layer_passes]="python benchmarks/layer_passes.py"
  [postops]="python benchmarks/postops.py"
)
ORDER=(small_nets inference step_graph data many_nets fused thread_bits conv_wgrad max_pool train_speed scaling serve zoo bf16 layer_passes postops)
names=("${@:-${ORDER[@]}}")
mkdir -p benchmarks/results
for name in "${names[@]}"; do
  cmd=${CMD[$name]:?unknown benchmark $name (known: ${ORDER[*]})}
  out=benchmarks/results/$name.txt
  {
    echo "# $cmd"
    echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "# cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p'), $(nproc) usable cores," \
         "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "# torch $(python -c 'import torch; print(torch.__version__)')"
  } > "$out"
  echo "== $name: $cmd"
  start=$(date +%s)
  $cmd 2>&1 | tee -a "$out"
  echo "# took $(( $(date +%s) - start )) s, load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out"
done

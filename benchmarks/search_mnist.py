"""``brewnet search`` on MNIST/LeNet, and the same trials trained one after another.

    python examples/mnist/get_mnist.py DATA          # the 60,000 training images (once)
    python benchmarks/search_mnist.py --mnist DATA [--trials 24 --group 4 --iters 5000 ...]

The search: Caffe's LeNet (``lenet_train_test.prototxt``) and solver (SGD, inv policy, weight
decay 0.0005, batch 64) with base_lr, momentum, conv1.num_output and ip1.num_output searched by
TPE, ``--trials`` trials in groups of ``--group``, the median pruner, the objective the TEST
accuracy over all 10,000 test images (test_iter 100 x 100) every ``--test-interval`` iterations,
each trial ``--iters`` iterations at most. Then each trial again, alone, one after another, for
the iterations it ran in the search (a pruned one stops where it was pruned): the wall time the
search's groups saved. ``--test-iter`` below 100 tests on the first 100 x N test images.
Prints both tables and writes the search's (plots, best) under ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("BREWNET_SHARED") or ROOT.parent / "shared")
T10K = SHARED / "caffe-models" / "trained" / "mnist_t10k" / "data" / "mnist"
LENET = SHARED / "caffe-models" / "bvlc" / "examples" / "mnist" / "lenet_train_test.prototxt"
SOLVER = ('net: "{net}" test_iter: {test_iter} test_interval: {ti} base_lr: 0.01 momentum: 0.9 '
          'weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 power: 0.75 display: 0 '
          'max_iter: {iters} snapshot: 0 solver_mode: CPU')
# Widths on a coarse grid, as a researcher sweeps them: trials asked at once whose widths come
# out alike are fused (see brewnet/many/search.py), the others trained together.
# base_lr to 0.05: above it 7 of 24 trials went to NaN at momentum ~0.9 (a 1000-iteration run).
SPACE = """base_lr: {log_uniform: [0.005, 0.05]}
momentum: {uniform: [0.8, 0.95]}
conv1.num_output: {int: [16, 48, step 16]}
ip1.num_output: {int: [250, 750, step 250]}
"""


def prepare(mnist: Path, work: Path) -> Path:
    """LMDBs of the 60,000 training and 10,000 test images, LeNet on them, its solver file."""
    from brewnet.cli import main
    from brewnet.proto.io import read_net, write_text

    dbs = {}
    for part, folder in (("train", mnist), ("t10k", mnist if (mnist / "t10k-images-idx3-ubyte").exists() else T10K)):
        db = work / f"mnist_{part}_lmdb"
        if not db.exists():
            images = next(folder.glob(f"{part}-images-idx3-ubyte*"))
            labels = next(folder.glob(f"{part}-labels-idx1-ubyte*"))
            assert main(["convert-mnist", str(images), str(labels), str(db)]) == 0
        dbs[part] = db
    net = read_net(str(LENET))
    for layer in net.layer:
        if layer.type == "Data":
            test = any(r.phase == 1 for r in layer.include)
            layer.data_param.source = str(dbs["t10k" if test else "train"])
    write_text(work / "lenet_train_test.prototxt", net)
    return work / "lenet_train_test.prototxt"


def one_after_another(study, work: Path) -> tuple[float, list]:
    """Each trial of ``study`` alone (the solver the search wrote for it), in order, for the
    iterations it ran: (wall s, CPU s of this process, per trial)."""
    from brewnet.many.study import counted
    from brewnet.solvers import get_solver, load_solver_param

    rows, t0, c0 = [], time.perf_counter(), time.process_time()
    for t in counted(study.get_trials(deepcopy=False)):
        if not t.state.is_finished() or not t.user_attrs.get("iters"):
            continue
        p, _ = load_solver_param(str(Path(t.user_attrs["folder"]) / "solver.prototxt"))
        for f in ("net", "train_net"):
            if p.HasField(f):
                setattr(p, f, str(Path(t.user_attrs["folder"]) / getattr(p, f)))
        p.max_iter = int(t.user_attrs["iters"])
        p.snapshot_after_train = False
        p.snapshot_prefix = str(work / "alone" / str(t.number))
        tic = time.perf_counter()
        s = get_solver(p)
        s.solve()
        rows.append((t.number, p.max_iter, time.perf_counter() - tic))
    return time.perf_counter() - t0, time.process_time() - c0, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mnist", type=Path, required=True, help="folder of the MNIST idx files")
    ap.add_argument("--out", type=Path, default=Path("search_mnist"))
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5000, help="max_iter of each trial")
    ap.add_argument("--test-interval", type=int, default=1000)
    ap.add_argument("--test-iter", type=int, default=100, help="test batches of 100 images (100: all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-sequential", action="store_true")
    ap.add_argument("--space", type=Path, help="a space file instead of the one above")
    ap.add_argument("--solver-fields-only", action="store_true",
                    help="search base_lr and momentum alone: one architecture, every group fused")
    a = ap.parse_args()
    logging.getLogger("brewnet").setLevel(logging.WARNING)
    a.out.mkdir(parents=True, exist_ok=True)
    net = prepare(a.mnist, a.out)
    solver = a.out / "lenet_solver.prototxt"
    solver.write_text(SOLVER.format(net=net, ti=a.test_interval, iters=a.iters, test_iter=a.test_iter))
    space = a.out / "space.yaml"
    text = a.space.read_text() if a.space else SPACE
    space.write_text("".join(line + "\n" for line in text.splitlines()
                             if not (a.solver_fields_only and "num_output" in line)))

    from tqdm import tqdm

    from brewnet.many import study as st
    from brewnet.many.search import Search

    with tqdm(total=a.trials, desc="trials") as bar:
        t0, c0 = time.perf_counter(), time.process_time()
        search = Search(str(solver), str(space), a.trials, str(a.out / "search"), group=a.group,
                        objective="accuracy:max", pruner="median", seed=a.seed, study="lenet",
                        on_told=lambda t: bar.update(1))
        study = search.run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st.copy_best(study, str(a.out / "search"))
    pngs = st.plots(study, str(a.out / "search"))
    trials = st.counted(study.get_trials(deepcopy=False))
    iters = sum(int(t.user_attrs.get("iters") or 0) for t in trials)
    engines = sorted({t.user_attrs.get("engine", "?") for t in study.get_trials(deepcopy=False)})
    print(f"Search of LeNet on MNIST ({len(space.read_text().splitlines())} fields; groups: "
          f"{', '.join(engines)}): {a.trials} trials, groups of {a.group}, median pruner, "
          f"max_iter {a.iters}, test every {a.test_interval} on {a.test_iter * 100} images; "
          f"torch threads {__import__('torch').get_num_threads()}")
    print(st.table(study))
    print(f"plots: {', '.join(os.path.basename(p) for p in pngs)}")
    print(f"search: {wall:.1f} s wall, {cpu:.1f} s CPU for {iters} iterations of training "
          f"(load average {os.getloadavg()[0]:.1f})")
    if a.skip_sequential:
        return
    seq, seq_cpu, rows = one_after_another(study, a.out)
    print(f"the same {len(rows)} trials one after another (same iterations each): {seq:.1f} s wall, "
          f"{seq_cpu:.1f} s CPU (load average {os.getloadavg()[0]:.1f})")
    print(f"search / one after another: wall {wall / seq:.2f}x ({seq / wall:.2f}x faster), "
          f"CPU {cpu / seq_cpu:.2f}x ({seq_cpu / cpu:.2f}x less)")


if __name__ == "__main__":
    main()

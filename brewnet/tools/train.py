"""``brewnet train --solver S [--weights W | --snapshot S]``: Caffe's ``caffe train``.

Caffe's rules: ``--snapshot`` (resume) and ``--weights`` (finetune) exclude each other;
``--weights`` replaces the solver's own ``weights``, ``--snapshot`` clears them; ``--level`` and
``--stage`` go into its ``train_state``; without ``--gpu`` the solver's ``solver_mode`` decides
(GPU: ``device_id`` when CUDA is here, else the CPU with a warning). ``--sigint_effect`` (default
stop) and ``--sighup_effect`` (default snapshot) act at the next iteration. Logs: glog's format.
Several workers (``brewnet.parallel``, Caffe 1.0's semantics: ``--gpu 0,1|all``, ``--workers N``
or ``torchrun``): rank 0 alone logs, tests and snapshots; ``--resume auto`` continues from the
newest snapshot. ``--tensorboard DIR``: TensorBoard event files of every logged number, a run
per solver named by its file (``brewnet.solvers.tensorboard``). Several ``--solver`` flags train
together (``brewnet.many.together``, ``--together-threads N``), or with ``--fuse`` as one fused net
(``brewnet.many.fused``).
The details: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import time
import types

from ..data.prefetch import data_busy
from ..execution.threads import plan_beside, replan_after
from .common import (
    USER_ERRORS,
    CLIError,
    add_gpu_flag,
    add_net_state_flags,
    parse_gpus,
    prefetching_layers,
    progress_bar,
    report,
    stages,
)

COMMAND = "train"
HELP = "train or finetune a model from a solver prototxt (Caffe's 'caffe train')"
EFFECTS = ("stop", "snapshot", "none")
log = logging.getLogger("brewnet")


def add_arguments(p) -> None:
    p.add_argument("--solver", "-solver", required=True, metavar="S", action="append",
                   help="the solver definition (.prototxt); repeat it to train several together")
    p.add_argument("--fuse", "-fuse", nargs="?", const="wide", default=None,
                   choices=["wide", "exact"],
                   help="with several --solver of one architecture: train them as one fused net; "
                        "wide (the default): grouped convolutions and batched products, within "
                        "float32 rounding of each net alone; exact: each net's own kernels, "
                        "bit for bit each net alone, at about one-by-one speed")
    p.add_argument("--dtype", "-dtype", choices=["float32", "float64"], default="float32",
                   help="with --fuse: train in float64 (each net equals its float64 run alone to "
                        "1e-10: the check that the fused algorithm is each net's own)")
    p.add_argument("--together-threads", "-together_threads", type=int, default=None, metavar="N",
                   help="with several --solver: worker threads stepping them at once (default "
                        "$BREWNET_TOGETHER_THREADS, else one per core when the nets are not tiny; "
                        "1: one after another)")
    p.add_argument("--weights", "-weights", default="", metavar="W1,W2",
                   help="pretrained .caffemodel(s) to finetune from, separated by ','")
    p.add_argument("--snapshot", "-snapshot", default="", metavar="S",
                   help="a .solverstate[.h5] to resume training from")
    p.add_argument("--deterministic", "-deterministic", action="store_true",
                   help="the same bits on any thread count and any machine of this CPU "
                        "architecture, at some cost in speed (BREWNET_DETERMINISTIC=1)")
    add_gpu_flag(p)
    p.add_argument("--workers", "-workers", type=int, default=None, metavar="N",
                   help="train on N CPU worker processes (data parallel, gloo)")
    p.add_argument("--resume", "-resume", choices=["auto"], default=None,
                   help="auto: resume from the newest snapshot under the solver's prefix, if any")
    p.add_argument("--timeout", "-timeout", type=float, default=300.0, metavar="S",
                   help="several workers: seconds to wait for the rendezvous and for a lost or "
                        "hung worker before stopping (default 300)")
    p.add_argument("--tensorboard", "-tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files under DIR: a run per solver (its file's "
                        "name) with its train and test outputs, smoothed loss, learning rate and "
                        "seconds per iteration (pip install 'brewnet[tensorboard]')")
    add_net_state_flags(p)
    p.add_argument("--sigint_effect", "-sigint_effect", default="stop", choices=EFFECTS,
                   help="on SIGINT (Ctrl-C): stop, snapshot or none (default stop)")
    p.add_argument("--sighup_effect", "-sighup_effect", default="snapshot", choices=EFFECTS,
                   help="on SIGHUP: stop, snapshot or none (default snapshot)")


def _solver_param(args, solver):
    """The solver file with the command line's overrides, its net paths made absolute so the
    message can be built from anywhere (the Solver resolves them as it does for files)."""
    from ..solvers import load_solver_param
    from ..solvers.nets import resolve

    param, path = load_solver_param(solver)
    param.train_state.level = args.level
    param.train_state.stage.extend(stages(args.stage))
    if args.snapshot or args.weights:
        del param.weights[:]
    if args.weights:
        param.weights.append(args.weights)
    for f in ("net", "train_net"):
        if param.HasField(f):
            setattr(param, f, str(resolve(getattr(param, f), path, "net").resolve()))
    for k, name in enumerate(param.test_net):
        param.test_net[k] = str(resolve(name, path, "test net").resolve())
    return param


def _child_argv(args) -> list[str]:
    argv = ["train", "--solver", args.solver[0], "--level", str(args.level), "--timeout", str(args.timeout),
            "--sigint_effect", args.sigint_effect, "--sighup_effect", args.sighup_effect]
    for flag in ("weights", "snapshot", "gpu", "stage", "resume", "tensorboard"):
        if getattr(args, flag):
            argv += [f"--{flag}", getattr(args, flag)]
    return argv


def _device(args, param, world=None):
    import torch

    from ..proto import caffe_pb2 as pb

    gpus = parse_gpus(args.gpu)
    if world is not None and gpus:
        if world.local_rank >= len(gpus):
            raise CLIError(f"--gpu {args.gpu}: LOCAL_RANK {world.local_rank} but {len(gpus)} "
                           "device(s) listed; start one worker per device")
        gpus = [gpus[world.local_rank]]
    if not gpus and param.solver_mode == pb.SolverParameter.GPU:   # GPU is Caffe's default mode
        if torch.cuda.is_available():
            gpus = [param.device_id]
        else:
            log.warning("solver_mode is GPU but CUDA is not available here; training on the CPU")
    if not gpus:
        log.info("Use CPU.")
        return torch.device("cpu")
    log.info("Using GPUs %d", gpus[0])
    log.info("GPU %d: %s", gpus[0], torch.cuda.get_device_name(gpus[0]))
    return torch.device("cuda", gpus[0])


def run(args) -> int:
    from ..analysis.glog import setup_logging

    setup_logging()
    if args.deterministic:
        import os

        from ..execution.determinism import set_deterministic

        os.environ["BREWNET_DETERMINISTIC"] = "1"      # data-parallel workers inherit it
        set_deterministic(True)
    if args.snapshot and args.weights:
        return report(COMMAND, "Give a snapshot to resume training or weights to finetune but not both.")
    if args.resume and args.snapshot:
        return report(COMMAND, "--resume auto finds the snapshot itself; give it or --snapshot, not both.")
    try:
        from ..parallel import plan

        world, spawn = plan(args.workers, parse_gpus(args.gpu))
        many = len(args.solver) > 1 or args.fuse
        if args.dtype != "float32" and not args.fuse:
            raise CLIError("--dtype float64 trains fused nets (--fuse); Caffe's runs are float32")
        if many and (spawn or world is not None):
            raise CLIError("several --solver (or --fuse) train in one process; data parallel "
                           "workers train one solver each")
        if args.tensorboard:
            from ..solvers.tensorboard import check

            check()
    except USER_ERRORS as e:
        return report(COMMAND, e)
    if spawn:
        from ..parallel import spawn as start_workers

        return start_workers(_child_argv(args), spawn, args.timeout)
    from ..solvers.guards import signal_effects

    # As Caffe, the handlers go in before the solver is built and stay until the command
    # ends: a Ctrl-C while the nets load is kept and acted on at the first iteration check,
    # and no SIGINT turns into a KeyboardInterrupt.
    holder, pending, told = [], [], set()

    def request(effect):
        if effect not in told:
            told.add(effect)
            log.info("Signal received: %s requested (acted on at the next iteration check)",
                     effect)
        (holder[0].request_action if holder else pending.append)(effect)

    with signal_effects(request, args.sigint_effect, args.sighup_effect):
        if many:
            return _train_many(args, holder, pending)
        return _train(args, holder, pending, world)


def _train(args, holder, pending, world) -> int:
    from ..parallel import Replicas, join, leave

    watch = replicas = None
    runs = []
    try:
        from ..solvers import get_solver
        from ..solvers.snapshot import latest

        if world is not None and world.rank:
            log.setLevel(logging.WARNING)        # Caffe: LOG_IF(INFO, root_solver())
        param = _solver_param(args, args.solver[0])
        device = _device(args, param, world)
        if world is not None:
            watch = join(world, device, args.timeout)
        for w in param.weights:
            log.info("Finetuning from %s", w)
        solver = get_solver(param, device=device)
        if world is not None:
            replicas = Replicas(solver, world.rank, world.size, watch, param.layer_wise_reduce)
        holder.append(replicas or solver)        # signals: the workers agree on them first
        for effect in pending:
            holder[0].request_action(effect)
        plan_beside(solver.net.layer_list)
        replan_after(solver, lambda seconds: data_busy([solver.net], seconds))
        resume = args.snapshot or (latest(param.snapshot_prefix) if args.resume else "")
        if args.resume:
            log.info("--resume auto: %s", f"resuming from {resume}" if resume else
                     f"no snapshot under {param.snapshot_prefix}_iter_*; starting from the start")
        if resume and (world is None or world.rank == 0):
            log.info("Resuming from %s", resume)
            log.info("Restoring previous solver status from %s", resume)
            solver.restore(resume)
        if replicas is not None:
            replicas.sync_from_root()
            solver.add_callback(replicas.on_start, replicas.on_gradients)
        if args.tensorboard and (world is None or world.rank == 0):
            runs = _tensorboard(args, [solver])
        log.info("Starting Optimization")
        with progress_bar(param.max_iter if world is None or world.rank == 0 else 0,
                          desc="train") as bar:
            if bar is not None:
                def advance(s=solver):
                    bar.update(s.iter + 1 - bar.n)
                    bar.set_postfix(loss=f"{float(s.loss):.4g}", refresh=False)
                solver.add_callback(on_gradients=advance)
            t0 = time.perf_counter()
            solver.solve()   # handlers are run()'s
        if replicas is not None:
            replicas.finish()
    except USER_ERRORS as e:
        return report(COMMAND, e)
    finally:
        leave(watch)
        for r in runs:
            r.close()
    wall = time.perf_counter() - t0
    wait = sum(l.data_wait_s for l in prefetching_layers(solver.net))
    if wait or prefetching_layers(solver.net):
        log.info("Waited %.3g s for training data: %.1f%% of %.4g s", wait, 100 * wait / (wall or 1), wall)
    log.info("Optimization Done.")
    return 0


def _train_many(args, holder, pending) -> int:
    """Several solvers in one process: together over shared data, or fused (``--fuse``)."""
    runs = []
    try:
        if args.snapshot:
            raise CLIError("--snapshot resumes one solver; with several --solver, resume them "
                           "one at a time")
        params = [_solver_param(args, s) for s in args.solver]
        device = _device(args, params[0])
        for k, f in enumerate(args.solver):
            log.info("Solver s%d: %s", k, f)
        if args.fuse:
            try:
                from ..many.fused import FusedSolvers
            except ImportError:
                raise CLIError("--fuse: the fused engine (brewnet.many.fused) is not in this "
                               "install; train them together without --fuse") from None
            import torch

            runner = FusedSolvers(params, device=device, exact=args.fuse == "exact",
                                  dtype=torch.float64 if args.dtype == "float64" else None)
            plan_beside(runner.solvers[0].net.layer_list)
        else:
            from ..many.together import TrainTogether

            runner = TrainTogether(params, device=device, threads=args.together_threads)
            runner.size_threads()
        act = getattr(runner, "request_action", None) or (
            lambda e: [s.request_action(e) for s in runner.solvers if hasattr(s, "request_action")])
        holder.append(types.SimpleNamespace(request_action=act))
        for effect in pending:
            act(effect)
        if args.tensorboard:
            runs = _tensorboard(args, runner.solvers)
        log.info("Starting Optimization")
        t0 = time.perf_counter()
        with progress_bar(sum(p.max_iter for p in params), desc="train") as bar:
            if bar is not None:
                for s in (s for s in runner.solvers if hasattr(s, "add_callback")):
                    s.add_callback(on_gradients=lambda r=runner: bar.update(
                        sum(x.iter for x in r.solvers) + 1 - bar.n))
            runner.solve()
    except USER_ERRORS as e:
        return report(COMMAND, e)
    finally:
        for r in runs:
            r.close()
    log.info("Trained %d solvers in %.4g s", len(params), time.perf_counter() - t0)
    log.info("Optimization Done.")
    return 0


def _tensorboard(args, solvers) -> list:
    """A TensorBoard run per solver under ``--tensorboard DIR``, named by its solver file."""
    import os

    from ..solvers.tensorboard import attach, run_names

    runs = [attach(s, os.path.join(args.tensorboard, name), hparams=None)
            for s, name in zip(solvers, run_names(args.solver))]
    log.info("TensorBoard: %s (tensorboard --logdir %s)", ", ".join(r.logdir for r in runs), args.tensorboard)
    return runs

"""The lean paths give the plain paths' numbers bit for bit on the CPU: the grouped
``_foreach`` updates of every rule, and the one-graph inference of pycaffe's ``Net.forward``
(with its fallback keeping Caffe's blob semantics)."""
import numpy as np
import pytest
import torch

import brewnet
from brewnet.proto import caffe_pb2 as pb
from brewnet.proto.io import parse_text

NET = """
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 2 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        param { lr_mult: 1 } param { lr_mult: 2 }
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
RULES = {
    "SGD": "momentum: 0.9", "Nesterov": "momentum: 0.9", "AdaGrad": "", "RMSProp": "rms_decay: 0.95",
    "AdaDelta": "momentum: 0.95 delta: 1e-6", "Adam": "momentum: 0.9 momentum2: 0.999",
}


def run(rule: str, extra: str, foreach: bool, iters: int = 6):
    p = parse_text(f'type: "{rule}" base_lr: 0.05 lr_policy: "fixed" weight_decay: 5e-3 '
                   f'max_iter: 10 random_seed: 7 solver_mode: CPU {extra}', pb.SolverParameter())
    p.net_param.CopyFrom(parse_text(NET, pb.NetParameter()))
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((4, 2, 8, 8)).astype(np.float32), rng.integers(0, 5, 4))
               for _ in range(iters)]
    s = brewnet.get_solver(p, train_feed=lambda i: {"data": batches[i][0], "label": batches[i][1]})
    s.foreach = foreach
    s.step(iters)
    return [t.detach().clone() for t in s.net.learnable], [h.clone() for h in s.history]


@pytest.mark.parametrize("rule,extra", [(r, e) for r, e in RULES.items()]
                         + [("SGD", "momentum: 0"), ("SGD", 'momentum: 0.9 regularization_type: "L1"')])
def test_foreach_updates_are_bit_identical(rule, extra):
    fast, plain = run(rule, extra, True), run(rule, extra, False)
    for a, b in zip(fast[0] + fast[1], plain[0] + plain[1]):
        assert torch.equal(a, b)


def test_subclass_overriding_compute_update_keeps_it():
    from brewnet.solvers import SGDSolver

    class Halved(SGDSolver):
        def compute_update(self, i, param, grad, local_rate):
            grad.mul_(0.5 * local_rate)

    p = parse_text('base_lr: 0.1 lr_policy: "fixed" max_iter: 1 solver_mode: CPU', pb.SolverParameter())
    p.net_param.CopyFrom(parse_text(NET, pb.NetParameter()))
    s = Halved(p)
    assert not s._foreach_ok()

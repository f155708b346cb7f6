"""NetParameter -> NetParameter steps run before anything is built (Caffe's ``Net::FilterNet``)."""
from __future__ import annotations

from . import caffe_pb2 as pb


def make_state(phase: int = pb.TEST, level: int = 0, stages=(), base=None) -> "pb.NetState":
    """A NetState: ``base`` (the prototxt's ``state``) overridden by phase and level, plus stages."""
    state = pb.NetState()
    if base is not None:
        state.CopyFrom(base)
    state.phase = phase
    state.level = level
    state.stage.extend(s for s in stages if s not in state.stage)
    return state


def rule_met(state, rule) -> bool:
    """Caffe's ``StateMeetsRule``: phase, level bounds, all ``stage``s, none of ``not_stage``."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    return all(s in stages for s in rule.stage) and not any(s in stages for s in rule.not_stage)


def layer_included(state, layer) -> bool:
    if layer.include and layer.exclude:
        raise ValueError(f"Layer '{layer.name}': specify either include rules or exclude rules, not both")
    if layer.include:
        return any(rule_met(state, r) for r in layer.include)
    return not any(rule_met(state, r) for r in layer.exclude)


def filter_net(net, state) -> "pb.NetParameter":
    """A copy of ``net`` holding only the layers its include/exclude rules keep for ``state``."""
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    out.layer.extend(l for l in net.layer if layer_included(state, l))
    out.state.CopyFrom(state)
    return out

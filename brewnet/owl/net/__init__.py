"""owl's ``owl.net`` package: ``net`` (the Net and its units), ``net_helper`` (CaffeNetBuilder),
``trainer`` (the tool classes), ``tools`` (HeatmapVisualizer's home in Minerva's last version)."""
from .net import *  # noqa: F401,F403
from .net_helper import *  # noqa: F401,F403
from .trainer import *  # noqa: F401,F403

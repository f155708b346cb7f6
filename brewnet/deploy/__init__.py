"""Deploying a Caffe net elsewhere: ``to_torch`` (one torch.fx graph), ONNX and torch.export
files (``export_onnx``, ``export_program``)."""
from .fx_export import to_torch  # noqa: F401
from .files import export_onnx, export_program  # noqa: F401

__all__ = ["to_torch", "export_onnx", "export_program"]

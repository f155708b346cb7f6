"""brewnet: Caffe, reborn as a Python toolkit on PyTorch."""
__version__ = "0.1.0"

"""normalization layers."""

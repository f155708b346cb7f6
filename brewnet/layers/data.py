"""data layers."""

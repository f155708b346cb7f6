"""common layers."""

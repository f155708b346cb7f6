"""vision layers."""

"""detection layers."""

"""``owl.net.tools``: where Minerva's last version kept ``HeatmapVisualizer`` (its
``heatmap_visualizer.py`` imports it from here); the class lives in ``trainer``."""
from .trainer import HeatmapVisualizer

__all__ = ["HeatmapVisualizer"]

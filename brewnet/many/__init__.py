"""Many networks in one process: merging nets, training them together, fusing them."""

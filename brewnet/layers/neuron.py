"""neuron layers."""

"""recurrent layers."""

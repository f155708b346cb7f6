"""Caffe math as pure torch functions (pooling ceil rule, LRN, ...), tested alone."""

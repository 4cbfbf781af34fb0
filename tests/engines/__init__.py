"""Tests of engines/: everything but the TensorRT calls runs here, on real exported artifacts."""

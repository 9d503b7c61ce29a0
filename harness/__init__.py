"""Regression and conformance harness for quantized model loading."""

"""Quantized and otherwise compressed models: per-layer sensitivity ranked by own error, and keep-in-float advice."""

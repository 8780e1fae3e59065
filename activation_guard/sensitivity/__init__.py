"""Sensitivity of a compressed model: each layer's own error ranked, keep-in-float advice and its closed-loop check."""

"""Gradient capture on autograd nodes, the loss a gradient golden differentiates, and its storage."""

"""Judges decide whether a live value is close enough to its golden: the protocol and the strict rule."""

"""Calibrated tolerances: noise floors from a float64 shadow run, and the rule that judges by them."""

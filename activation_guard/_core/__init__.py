"""Small utilities every layer may use: errors, dtypes, devices, the comparison kernel, switches."""

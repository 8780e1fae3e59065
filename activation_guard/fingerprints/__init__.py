"""Fixed-size fingerprints of tensors: their parameters, kernel, worker thread and sound checks."""

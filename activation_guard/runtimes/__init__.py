"""Deployment runtimes as sources of live values: an ONNX model run in ONNX Runtime, per eager module call."""

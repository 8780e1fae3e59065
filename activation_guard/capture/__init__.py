"""Hooks on a live eager model: which module call returned what, and recording it into a golden."""

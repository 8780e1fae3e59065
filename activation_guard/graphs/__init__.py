"""Live values from a torch.fx graph (an exported program's module, a PT2E model), per eager module call."""

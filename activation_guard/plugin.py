"""pytest plugin glue (see issue: pytest plugin). Placeholder until the plugin lands."""

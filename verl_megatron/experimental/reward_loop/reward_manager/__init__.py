"""Per-sample (async) reward managers of verl's reward loop."""

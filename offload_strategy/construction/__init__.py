"""Models built without memory (deferred parameters) and weights read straight into their homes."""

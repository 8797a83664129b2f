"""The engine: units moved between tiers, their hooks, and the collaborators that move each kind of state."""

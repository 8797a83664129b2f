"""The searches the planner runs, each named after what it computes; each module's docstring cites its paper."""

"""miles-r3 plugin package."""

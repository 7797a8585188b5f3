"""miles-int4 plugin package."""

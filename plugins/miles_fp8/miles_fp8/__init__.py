"""miles-fp8 plugin package."""

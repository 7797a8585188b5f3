"""miles-spec plugin package."""

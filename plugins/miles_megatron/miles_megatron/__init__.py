"""miles-megatron plugin package."""

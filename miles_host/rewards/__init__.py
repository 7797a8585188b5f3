"""Built-in reward functions (``--rm-type``)."""

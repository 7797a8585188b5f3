"""``--buffer-filter-path``: which groups of the partial-rollout buffer the next rollout takes.

With ``--partial-rollout`` the groups a rollout did not use (unfinished, or beyond the
batch) wait in a buffer and continue first in the next rollout. Without the flag every
buffered group is taken. With it, slime's ``buffer_filter(args, rollout_id, buffer,
num_samples)`` is called with the buffer (a list of groups it may reorder or pop from) and
the batch size in groups; it returns the groups to take, and what it leaves in the buffer
waits for a later rollout.
"""

from __future__ import annotations

from typing import Any

from miles_host.reward import load_function

FLAG = "--buffer-filter-path"


def take_buffered(config: Any, rollout_id: int, buffer: list[list[Any]],
                  function: Any = None) -> tuple[list[list[Any]], list[list[Any]]]:
    """(the groups the rollout continues, the groups left in the buffer)."""
    path = getattr(config, "buffer_filter_path", None)
    if function is None and not path:
        return list(buffer), []
    if not buffer:
        return [], []
    function = function or load_function(path, FLAG)
    left = list(buffer)
    taken = function(config, rollout_id, left, config.rollout_batch_size)
    if not isinstance(taken, list) or not all(isinstance(group, list) for group in taken):
        raise TypeError(f"{FLAG} {path}: returned {type(taken).__name__}; a buffer filter returns the groups to "
                        "take (list[list[Sample]])")
    taken_ids = {id(group) for group in taken}
    return taken, [group for group in left if id(group) not in taken_ids]

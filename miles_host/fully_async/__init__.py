"""``--fully-async``: rollout keeps generating while the trainer trains.

:mod:`~miles_host.fully_async.buffer` (finished groups, the staleness gate),
:mod:`~miles_host.fully_async.producer` (the generating thread),
:mod:`~miles_host.fully_async.run` (the loop).
"""

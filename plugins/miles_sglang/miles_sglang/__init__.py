"""miles-sglang: SGLang's HTTP protocol on both ends.

- ``miles serve``: the embedded engine behind SGLang's native endpoints
  (:mod:`miles_sglang.server`), so tests have a real server and users a drop-in one.
- rollout backend ``sglang`` (:mod:`miles_sglang.backend`): a client of that API,
  which also talks to real SGLang servers.
- weight-sync transports ``sglang_tensor`` and ``sglang_disk`` (:mod:`miles_sglang.transport`).
"""

__version__ = "0.1.0"

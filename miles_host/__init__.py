"""miles: plugin-based RL post-training for large language models (the host).

The host defines the hook specifications (:mod:`miles_host.hookspecs`), finds and
registers plugins (:mod:`miles_host.plugin_manager`), runs the RL loop, and ships
embedded defaults (registered as built-in plugins) that run on one machine.
"""

__version__ = "0.1.0"

from miles_host.sample import Sample, Status  # noqa: E402

__all__ = ["Sample", "Status", "__version__"]

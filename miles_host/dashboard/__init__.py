"""The run dashboard: a FastAPI app over run output directories and a static page.

- :mod:`miles_host.dashboard.samples` writes, for the rollout browser, a few samples of each
  step (tokens, log-probs, loss mask, routed-expert agreement) under
  ``<output_dir>/dashboard/samples/``;
- :mod:`miles_host.dashboard.runs` reads a run directory (``metrics.jsonl`` from a byte
  offset, for live tailing; the sample files; the step timeline from the timing metrics);
- :mod:`miles_host.dashboard.app` serves them as JSON next to the page in ``static/``
  (uPlot vendored under ``static/vendor``, so nothing is fetched at run time);
- :mod:`miles_host.dashboard.logger` serves it during a run (``--use-miles-dashboard``);
  ``miles dashboard OUTPUT_DIR ...`` serves finished or running runs.
"""

"""miles-models: model-family adapters for miles (Qwen, Llama, DeepSeek, GLM, MiniMax, Gemma).

Each family module is a plugin registered in the ``miles.plugins`` entry-point
group; it returns :class:`~miles_host.records.ModelFamily` records from
``miles_register_model_families``. Shared helpers: :mod:`miles_models._weights`
(HF <-> native weight names) and :mod:`miles_models._config` (config parsing).
"""

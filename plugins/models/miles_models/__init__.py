"""miles-models: model-family adapters for miles (Qwen, Llama, DeepSeek, GLM, MiniMax, Gemma, gpt-oss, Llama-4).

Each family module is a plugin registered in the ``miles.plugins`` entry-point
group; it returns :class:`~miles_host.records.ModelFamily` records from
``miles_register_model_families``. Shared helpers: :mod:`miles_models._weights`
(HF <-> native weight names), :mod:`miles_models._transforms` (checkpoint layouts that
are permutations of the native tensors), :mod:`miles_models._mxfp4` (MXFP4 experts) and
:mod:`miles_models._config` (config parsing).
"""

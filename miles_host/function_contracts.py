"""Calling conventions of user functions: slime's and miles' own, told apart up front.

Three flags name a user function that slime also takes, each with two contracts:

- ``--custom-rm-path``: slime's ``reward(args, sample, **kwargs)`` (``samples`` with
  ``--group-rm``), miles' ``reward(sample, config=None)``;
- ``--dynamic-sampling-filter-path``: slime's ``filter(args, samples, **kwargs)`` returning a
  bool or a ``DynamicFilterOutput``, miles' ``filter(group, scalar)`` returning a bool;
- ``--custom-generate-function-path``: slime's ``generate(args, sample, sampling_params)``,
  miles' ``generate(args, sample, sampling_params, session)``.

The contract is read from the function before the run starts, never guessed from a
failure: a function may say it with ``fn.miles_contract = "slime"`` or ``"miles"``;
otherwise its signature decides. A reward or filter whose first parameter is named
``args`` is slime's (the name every slime example uses; miles' reward starts with
``sample`` and miles' filter with ``group``); a generate function with three positional
parameters is slime's, four miles'. :func:`adapt` returns a function with miles'
contract either way, so the rest of the run calls one convention.

slime's filter-hub paths (``slime.rollout.filter_hub...``) name the built-in filter with
the same rule (:data:`SLIME_FUNCTIONS`); :class:`DynamicFilterOutput` is slime's filter result.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from miles_host.function_loading import load_function

#: the contract names a function may declare as ``fn.miles_contract``
CONTRACTS = ("slime", "miles")

#: slime's module paths that name a miles function keeping the same rule
SLIME_FUNCTIONS = {
    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std":
        "miles_host.rollout_manager.keep_group_with_signal",
}


@dataclass
class DynamicFilterOutput:
    """slime's filter result, for slime-contract filters written without slime installed:
    ``keep`` the group or not, and why not (``reason``)."""

    keep: bool
    reason: str | None = None


@dataclass(frozen=True)
class Contract:
    """How one flag's function is recognised and called."""

    flag: str
    #: the first parameter's name that marks slime's contract (reward, filter), or None
    slime_first_parameter: str | None
    #: the positional parameter count of slime's contract (generate), or None
    slime_positional: int | None
    miles_form: str
    slime_form: str


CONTRACTS_BY_FLAG = {
    "custom_rm_path": Contract("--custom-rm-path", "args", None, "reward(sample, config=None)",
                               "async def reward(args, sample, **kwargs)"),
    "dynamic_sampling_filter_path": Contract("--dynamic-sampling-filter-path", "args", None, "filter(group, scalar)",
                                             "filter(args, samples, **kwargs)"),
    "custom_generate_function_path": Contract("--custom-generate-function-path", None, 3,
                                              "generate(args, sample, sampling_params, session)",
                                              "async def generate(args, sample, sampling_params)"),
}


def _positional(function: Callable) -> list[inspect.Parameter]:
    signature = inspect.signature(function)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in signature.parameters.values() if p.kind in kinds]


def contract_of(function: Callable, field_name: str) -> str:
    """``"slime"`` or ``"miles"``: the declared ``miles_contract``, else the signature's."""
    spec = CONTRACTS_BY_FLAG[field_name]
    declared = getattr(function, "miles_contract", None)
    if declared is not None:
        if declared not in CONTRACTS:
            raise ValueError(f"{spec.flag}: {function.__qualname__}.miles_contract is {declared!r}; give one of "
                             f"{', '.join(CONTRACTS)}")
        return declared
    try:
        positional = _positional(function)
    except (TypeError, ValueError):  # no signature (some builtins): miles' contract
        return "miles"
    if spec.slime_first_parameter is not None:
        return "slime" if positional and positional[0].name == spec.slime_first_parameter else "miles"
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    return "slime" if len(required) == spec.slime_positional and len(positional) == spec.slime_positional else "miles"


def load_user_function(path: str, field_name: str) -> Callable:
    """The function ``path`` names (slime's filter-hub paths mapped), unadapted."""
    flag = CONTRACTS_BY_FLAG[field_name].flag
    return load_function(SLIME_FUNCTIONS.get(path, path), flag)


def adapt(function: Callable, field_name: str, config: Any) -> Callable:
    """``function`` called with miles' contract for ``field_name``'s flag."""
    if contract_of(function, field_name) == "miles":
        return function
    return _ADAPTERS[field_name](function, config)


def load_adapted(path: str, field_name: str, config: Any) -> Callable:
    """:func:`load_user_function` then :func:`adapt`."""
    return adapt(load_user_function(path, field_name), field_name, config)


def _slime_reward(function: Callable, config: Any) -> Callable:
    if inspect.iscoroutinefunction(function):
        async def reward(sample: Any, _config: Any = None) -> Any:
            return await function(config, sample)
    else:
        def reward(sample: Any, _config: Any = None) -> Any:
            return function(config, sample)
    reward.__qualname__ = getattr(function, "__qualname__", "reward")
    return reward


def _slime_filter(function: Callable, config: Any) -> Callable:
    def keep_group(group: list, scalar: Callable[[Any], float]) -> bool:
        result = function(config, group)
        keep = getattr(result, "keep", result)  # slime's DynamicFilterOutput(keep, reason) or a bool
        if not isinstance(keep, bool) and type(keep).__name__ not in ("bool_", "Tensor"):
            raise TypeError(f"--dynamic-sampling-filter-path {function.__qualname__} returned {result!r}; a filter "
                            "returns a bool or an object with a bool .keep (slime's DynamicFilterOutput)")
        return bool(keep)
    return keep_group


def _slime_generate(function: Callable, config: Any) -> Callable:
    raise ValueError(
        f"--custom-generate-function-path {function.__qualname__} has slime's contract (args, sample, "
        "sampling_params): it sends its requests to an SGLang router's /generate, which the miles engines do not "
        "serve. Add a fourth parameter `session` and generate with `await session.async_generate(input_ids, "
        "sampling_params)` (the same request and response fields as SGLang's /generate), or set "
        "fn.miles_contract = 'miles' if the signature misleads")


_ADAPTERS: dict[str, Callable[[Callable, Any], Callable]] = {
    "custom_rm_path": _slime_reward,
    "dynamic_sampling_filter_path": _slime_filter,
    "custom_generate_function_path": _slime_generate,
}

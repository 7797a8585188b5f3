"""Built-in plugin: the ``--rm-type`` rewards.

slime's reward hub (:mod:`miles_host.rewards.hub`): ``math``, ``deepscaler``, ``dapo``,
``f1``, ``gpqa``, ``ifbench``, ``random``, ``remote_rm`` (with ``--rm-url``) and every
``boxed_<type>``; a sample's ``metadata["rm_type"]`` overrides the configured type, as in
slime. ``exact`` (normalised exact match) is miles' own.
"""

from __future__ import annotations

from miles_host.records import RewardFunction
from miles_host.rewards import answers, hub

#: types whose scorer reads the label (a sample without one is a data error, not a 0)
_NEEDS_LABEL = {"math", "deepscaler", "dapo", "f1"}

_DESCRIPTIONS = {
    "math": "slime's math: last \\boxed{} vs label (mathd normalisation, then sympy)",
    "deepscaler": "slime's deepscaler: boxed answer after </think> (or ###Response), graded as math",
    "dapo": "slime's dapo: last 'Answer:' vs the integer label; {score: 1 | -1, acc, pred}",
    "f1": "slime's f1: token-level F1 against the label (yes/no/noanswer must match exactly)",
    "gpqa": "slime's gpqa: chosen option letter vs the right one (label, metadata choices/correct_letter)",
    "ifbench": "slime's ifbench: IFBench strict instruction following (needs allenai's IFBench on PYTHONPATH)",
    "random": "slime's random: 0 or 1 at random",
    "remote_rm": "slime's remote_rm: POST {prompt, response, label} to --rm-url",
}


def hub_reward(rm_type: str):
    """The reward function of hub type ``rm_type`` (``boxed_`` prefix understood)."""
    needs_label = rm_type.removeprefix(hub.BOXED_PREFIX) in _NEEDS_LABEL

    def reward(sample, config=None):
        if needs_label and sample.label is None and not (sample.metadata or {}).get("rm_type"):
            raise ValueError(f"--rm-type {rm_type} needs a label: set --label-key to the label's key in the data")
        return hub.score_sample(sample, config, rm_type)

    reward.__name__ = f"rm_{rm_type}"
    return reward


def _describe(name: str) -> str:
    if name.startswith(hub.BOXED_PREFIX):
        return f"the last \\boxed{{}} content of the response scored as {name[len(hub.BOXED_PREFIX):]}"
    return _DESCRIPTIONS[name]


def _exact(sample, config=None):
    if sample.label is None:
        raise ValueError("this reward needs a label: set --label-key to the label's key in the data")
    return answers.exact_reward(sample.response, sample.label)


def miles_register_reward_functions():
    """The host's built-in rewards."""
    records = [RewardFunction(name, _describe(name), fn=hub_reward(name)) for name in hub.rm_types()]
    records.append(RewardFunction("exact", "normalised exact match against the label", fn=_exact))
    return records

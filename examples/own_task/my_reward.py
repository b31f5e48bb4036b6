"""A reward of one's own for drpo (rollout.reward: {type: python, function: "my_reward:score"}).

drpo calls ``score(sample, **kwargs)`` once per sampled response, in the rollout worker's process;
``sample`` is a ``rollout.rewards.RewardInput``: the prompt (``prompt`` text and chat ``messages``),
the ``response`` text and ``response_ids``, the ``finish_reason``, the row's ``ground_truth`` and
every other column of the row in ``metadata``. Return a float, or a dict with the ``score`` and
named ``components`` (logged as reward/component/<name>). An exception scores that sample 0 and is
counted (rollout.reward.on_error), never ends the run by itself.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(sample, format_weight=0.1):
    reply = sample.response.strip()
    unit = sample.metadata.get("unit", "")  # a column of the dataset row
    numbers = NUMBER.findall(reply)
    correct = float(bool(numbers) and float(numbers[0]) == float(sample.ground_truth))
    bare = reply.removesuffix(unit).strip() if unit else reply
    well_formed = float(NUMBER.fullmatch(bare) is not None)  # the number alone (and the unit, if the row has one)
    return {"score": correct + format_weight * well_formed, "components": {"correct": correct, "format": well_formed}}

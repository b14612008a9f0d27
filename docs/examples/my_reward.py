"""A reward function of your own, as verl calls it: one call per response (``reward_model.reward_manager=naive``).

Used by the Quickstart's "your model, your data, your reward" example:
``custom_reward_function.path=docs/examples/my_reward.py``. Return a number, or a dict with ``score`` (and
optionally ``acc`` and any extra keys, which are logged).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response starts with the expected answer (``"12+7="`` -> ``"19..."``), else 0."""
    answer = str(ground_truth)
    return float(solution_str.strip().startswith(answer))

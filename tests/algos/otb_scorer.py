"""A test scorer whose reward varies within every group (the tiny model's sums are rarely right at its
initial weights, so the task's own reward would give all-zero groups and all-zero advantages): a
deterministic function of the response text, in {0, 1/3, 2/3, 1}."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 4) / 3.0

"""Prompt data in verl's row format (``prompt`` as chat messages, ``data_source``, ``reward_model.ground_truth``).

* ``dataset``: parquet / jsonl datasets, the overlong-prompt filter, and the resumable shuffled sampler.
* ``synthetic``: the shipped arithmetic task the tiny CPU recipe trains on.
* ``convert``: GSM8K- and MATH-style files on disk -> verl's rows (``python -m trainer.data.convert``).
"""

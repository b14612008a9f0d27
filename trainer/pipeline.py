"""The user-facing name of the step's API: ``trainer.pipeline=pkg.module:function`` pipelines import
``Step`` and ``default_pipeline`` from here (docs/extending.md). The code lives in :mod:`trainer.step`."""

from trainer.step import Hooks, PipelineError, Step, default_pipeline, load_callable  # noqa: F401

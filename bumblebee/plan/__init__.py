"""Planner: analytic memory estimator, throughput model and recipe (``bumblebee plan``).

Works from a model's Hugging Face config (``spec.py``) and a hardware table
(``hardware.py``), with no GPU: ``memory.py`` predicts per-GPU memory of each
pipeline stage, ``perf.py`` the step time (``perf_layer.py`` one layer's), ``recipe.py`` applies the default
recipe and ranks alternatives, ``dryrun.py`` checks the memory model against
the real model code under ``FakeTensorMode``, ``report.py`` prints and plots,
``cli.py`` is the command. Nothing outside the CLI imports this package.
"""

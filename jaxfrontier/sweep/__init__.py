"""Throughput sweeps and scaling studies (`python -m jaxfrontier.sweep`, `python -m jaxfrontier.scaling`).

Layers, top to bottom: `cli` (the sweep's flags and entry) -> `flags` (what sweep and scaling
share: study setup, launcher, flag parsing) -> `run` (the study: trials, results file) and
`launch` (trial commands: local or `srun`) -> `trials`, `space` (points, records), `plan`
(the planner filter), `report` (Markdown, CSV, plots), `deephyper` (Bayesian search).
"""

"""Evaluation helpers for kvweave: synthetic long-context tasks (:mod:`kvweave.eval.tasks`) and scoring."""

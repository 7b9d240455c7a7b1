"""Drafter heads that read the target's hidden states (EAGLE-3), in plain torch: their shape, weights and files.

Imports nothing of rl_specdec, so the engines' weight checks, the toy builds and
the trainers all use the one definition.
"""

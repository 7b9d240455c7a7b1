"""Drafter heads that read the target's hidden states (EAGLE-3): all of the head's code.

``eagle3`` (the head in plain torch: shape, weights, files, loss) and ``forms`` (the published forms taken) import
nothing of rl_specdec, so the engines' weight checks, the builds and the trainers use the one definition, and a
machine with torch alone can run it. ``training`` trains a head inside the policy worker; ``build`` builds one at
first use from a toy pair's data or a packaged chat model's own answers.
"""

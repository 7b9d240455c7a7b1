"""What speculation buys on a GPU, predicted.

A step-cost model t(b, k) per (device, model pair) from each device's roofline
(:mod:`.hardware`, :mod:`.models`, :mod:`.costmodel`), calibrated where we can
measure (this CPU: :mod:`.calibrate`), driving a discrete-event simulation of a
GRPO generation phase (:mod:`.simulate`) under each policy that chooses k
(:mod:`.policies`), the package's own controller among them (:mod:`.adapter`).
:mod:`.report` prints the tables and draws the plot; ``benchmarks/gpu/gpu_whatif.py`` (python -m benchmarks gpu-whatif)
is the command line.

Everything here is a prediction from stated constants, not a measurement.
"""

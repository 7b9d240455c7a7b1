"""What rl_specdec runs inside vLLM's engine process for speculation under run-time control.

:mod:`rl_specdec.generation.engine_ext` stays the entry point that vLLM resolves
by name (the worker extension, the CPU executor); the speculation code behind
it outgrew one file and lives here, one concern per module:

* :mod:`.scheduler`: ``SettableKScheduler``, vLLM's scheduler whose
  batch-size -> k lookup can be replaced at run time (engine argument
  ``scheduler_cls``, built lazily so that importing this package does not
  import vLLM);
* :mod:`.fastpath`: per-instance wrappers on the model runner that run a step
  with nothing to verify and nothing to draft as a plain, non-speculative
  step (the k=0 fast path), and write one record per engine step;
* :mod:`.catchup`: the drafter forward that fills the drafter's KV cache for
  the positions it skipped during plain steps;
* :mod:`.controller`: the adaptive controller (pure logic, no vLLM), which
  learns the step cost and the acceptance from the records and picks k per
  batch-size bucket;
* :mod:`.control`: the worker-extension methods (``collective_rpc``) that
  install all of it, set k, report, and run the start-up self-check.
"""

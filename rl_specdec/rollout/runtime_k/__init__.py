"""Run-time k: each engine changes its number of drafted tokens while it runs
(``policy.generation.speculation_control``).

Installed where ``speculation_control.mode`` is not ``off``, for the methods whose row in
:mod:`rl_specdec.vllm_ext.methods` has ``runtime_k`` (``draft_model``, ``eagle3``, ``ngram``; the controller for
those with ``controller``). Its parts:

* the engine arguments it needs (vLLM's dynamic-k mode, k_max, the scheduler class) are built with every
  other engine argument in :mod:`rl_specdec.config.engine_args`;
* :mod:`.startup`: its installation in a new engine, and the start-up self-check of the k=0 fast path;
* :mod:`.control`: the ``collective_rpc`` methods (install, set k, report) and the per-engine state;
* :mod:`.controller`: the adaptive controller (pure logic, numpy only), which picks k per batch-size bucket;
* :mod:`.controller_state`: its records: what each (bucket, k) measured, and the exploration burst it runs;
* :mod:`.selfcheck`: the start-up self-check's phases and its hooks on the fast path;
* :mod:`.metrics`: the ``spec_decode/*`` metrics of its reports.

What it needs of vLLM's internals (the scheduler subclass, the k=0 fast path's
wrappers on the model runner, the drafter's KV catch-up) is in
:mod:`rl_specdec.vllm_ext`; its load-time checks are in
:mod:`rl_specdec.config.speculation`.
"""

"""Engines spread over the nodes of a Ray cluster (two simulated nodes on this machine).

Runs its own Ray instance (``ray.cluster_utils.Cluster``): any Ray instance
left by an earlier module is shut down first, and the cluster is shut down at
the end of the module.
"""

from __future__ import annotations

import pytest

from conftest import NGRAM, actor_states, hf_greedy, start_engine, wait_until
from rl_specdec.config import ClusterConfig
from rl_specdec.rollout import SamplingSettings

pytestmark = pytest.mark.integration

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def spread(request, cluster, toy):
    g = start_engine(
        toy.policy,
        NGRAM,
        num_engines=2,
        cpus_per_engine=1,
        cluster=ClusterConfig(address=cluster.address, placement_strategy="STRICT_SPREAD"),
    )
    request.addfinalizer(g.shutdown)
    return g


def test_cluster_has_two_nodes(cluster):
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    assert all(n["Resources"].get("CPU") == 1 for n in nodes)


def test_engines_are_spread_over_both_nodes(spread):
    nodes = [p["node_id"] for p in spread.placements]
    assert len(nodes) == 2 and nodes[0] != nodes[1], nodes
    # both simulated nodes live on this host: the engines still get disjoint cores
    assert [i["cpu_bind"] for i in spread.engine_info] == ["0", "1"]


def test_spread_greedy_equals_single_node(spread, hf_policy, task_prompts):
    """Same outputs as transformers' greedy decoding, which the single-node engines match (test_generation.py)."""
    out = spread.generate(task_prompts, SamplingSettings(max_tokens=MAX_TOKENS, temperature=0.0))
    assert out.token_ids == hf_greedy(hf_policy, task_prompts, MAX_TOKENS)
    assert len(out.per_engine_time_s) == 2


def test_too_many_engines_for_the_cluster_fails_clearly(cluster, toy, monkeypatch):
    """STRICT_SPREAD with more engines than nodes cannot be placed: a clear error, no leaked actors."""
    import ray
    from ray.util.placement_group import placement_group_table

    before = placement_group_table()
    monkeypatch.setattr(ray, "get", _short_timeout(ray.get))
    with pytest.raises(RuntimeError, match=r"Ray could not reserve 3 x \{'CPU': 1\}"):
        start_engine(
            toy.policy,
            None,
            num_engines=3,
            cpus_per_engine=1,
            cluster=ClusterConfig(address=cluster.address, placement_strategy="STRICT_SPREAD"),
        )
    after = placement_group_table()
    new = [pg for pid, pg in after.items() if pid not in before]
    assert all(pg["state"] == "REMOVED" for pg in new), new


def _short_timeout(get):
    """ray.get with the placement-group wait shortened from 120 s to 3 s."""

    def wrapped(refs, *a, timeout=None, **k):
        return get(refs, *a, timeout=3 if timeout == 120 else timeout, **k)

    return wrapped


def test_shutdown_leaves_no_worker_alive(spread):
    spread.shutdown()
    wait_until(lambda: "ALIVE" not in actor_states().values())
    alive = [aid for aid, state in actor_states().items() if state == "ALIVE"]
    assert alive == [], f"VllmWorker actors still alive after shutdown: {alive}"

"""A simulated Ray cluster on loopback for the Ray device tests: a head (no `llamapy` resource)
and N nodes offering {"llamapy": 1}, small object stores (ray.cluster_utils.Cluster).

Run it only inside a network namespace with nothing but loopback (`unshare -n`, `ip link set lo
up`): Ray then binds 127.0.0.1; outside one it would bind the host's address."""

from __future__ import annotations

import os

STORE = 80 * 2**20  # bytes of object store per node


def start(n_nodes: int = 2):  # -> ray.cluster_utils.Cluster
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": STORE, "include_dashboard": False},
    )
    for _ in range(n_nodes):
        c.add_node(num_cpus=1, resources={"llamapy": 1}, object_store_memory=STORE)
    c.wait_for_nodes()
    return c

"""A simulated Ray cluster on loopback for the Ray device tests: a head (no `llamapy` resource)
and N nodes offering {"llamapy": 1}, small object stores (ray.cluster_utils.Cluster).

Run it only inside a network namespace with nothing but loopback (`unshare -n`, `ip link set lo
up`): Ray then binds 127.0.0.1; outside one it would bind the host's address."""

from __future__ import annotations

import os
import secrets

STORE = 80 * 2**20  # bytes of object store per node


def start(n_nodes: int = 2):  # -> ray.cluster_utils.Cluster
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # token authentication, as llamapy asks for when it connects: every process started from
    # here (the nodes, the llamapy drivers of the tests) inherits the token
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from ray.cluster_utils import Cluster  # after the environment: Ray reads it on import

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": STORE, "include_dashboard": False},
    )
    for _ in range(n_nodes):
        c.add_node(num_cpus=1, resources={"llamapy": 1}, object_store_memory=STORE)
    c.wait_for_nodes()
    return c

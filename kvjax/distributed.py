"""Several processes (hosts) running one job with JAX's multi-controller runtime.

Every process runs the same program. `initialize` joins them (`jax.distributed.initialize`)
before JAX starts its backend; from then on `jax.devices()` lists every process's devices,
`kvjax.parallel.make_mesh()` lays a mesh over all of them, and each compiled program runs
on all processes at once, XLA's collectives passing data between them (gloo over TCP on
CPU). A process holds only the shards on its own devices (`jax.local_devices()`).

What only one process does (writing logs, run.json, the loss curve; orbax's own files) is
done by the primary one, process 0 (`is_primary`); `check_same` refuses a job whose
processes were started differently; `host_arrays` brings whole arrays to the host from
shards spread over processes. A function here that runs a compiled program must be called
by every process, in the same order: that is what keeps the processes in step.

Where no process of the job can reach a peer (it was killed, its host went down) the
others end within about `heartbeat_timeout` seconds: JAX's coordination service stops
every process once a peer stops sending heartbeats, and a collective whose peer closed its
connection fails at once.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

ENV_COORDINATOR = "KVJAX_COORDINATOR"  # HOST:PORT of process 0's coordination service
ENV_NUM_PROCESSES = "KVJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "KVJAX_PROCESS_ID"
HEARTBEAT_TIMEOUT = 20  # seconds without a heartbeat after which a process counts as dead
INITIALIZATION_TIMEOUT = 300  # seconds to wait for every process to join
SHUTDOWN_TIMEOUT = 30  # seconds a finished process waits for the others at exit


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_devices: int | None = None,
               heartbeat_timeout: int = HEARTBEAT_TIMEOUT,
               initialization_timeout: int = INITIALIZATION_TIMEOUT) -> bool:
    """Joins this process to a job of several; returns whether it did (False: one process).

    `coordinator` ("HOST:PORT" of process 0, which serves there), `num_processes` and
    `process_id` (0 ... num_processes - 1) default to the environment variables
    KVJAX_COORDINATOR, KVJAX_NUM_PROCESSES and KVJAX_PROCESS_ID. Where none of the three is
    given, JAX's own detection of a TPU pod slice, SLURM or Open MPI job fills them in;
    without any of those this is a one-process run and nothing is started.

    `cpu_devices` is how many CPU devices each process shows (`jax_num_cpu_devices`), for
    several processes on one machine without accelerators. CPU collectives between processes
    go through gloo. Must run before anything asks JAX for a device or computes; raises a
    ValueError naming a bad value (a `process_id` not below `num_processes`, a coordinator
    that is not HOST:PORT). Called again in a process already joined (a notebook running
    `kvjax train` twice), it checks the numbers against the job's and starts nothing.
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _count(num_processes, ENV_NUM_PROCESSES, "num_processes", 1)
    process_id = _count(process_id, ENV_PROCESS_ID, "process_id", 0)
    if coordinator is not None:
        _check_address(coordinator)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(f"process_id={process_id} must be below num_processes="
                         f"{num_processes} (processes are numbered 0 ... {num_processes - 1})")
    if jax.distributed.is_initialized():
        joined = {"num_processes": jax.process_count(), "process_id": jax.process_index()}
        for name, value in (("num_processes", num_processes), ("process_id", process_id)):
            if value is not None and value != joined[name]:
                raise ValueError(f"{name}={value}, but this process already runs as "
                                 f"{name}={joined[name]} of its job")
        return True
    if cpu_devices is not None:
        if cpu_devices < 1:
            raise ValueError(f"cpu_devices={cpu_devices} must be >= 1")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    given = (coordinator, num_processes, process_id)
    if all(value is None for value in given) and not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes, process_id, initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout, shutdown_timeout_seconds=SHUTDOWN_TIMEOUT)
    return True


def _count(value: int | None, variable: str, name: str, low: int) -> int | None:
    if value is None and os.environ.get(variable):
        text = os.environ[variable]
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{variable}={text!r} is not an integer") from None
        name = variable
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < low):
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return value


def _check_address(address: str) -> None:
    host, colon, port = address.rpartition(":")
    if not (colon and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"coordinator {address!r} is not HOST:PORT (e.g. 10.0.0.1:1234, "
                         "a port in 1 ... 65535)")


# The environments JAX's start-up detects that kvjax starts a job in by itself. Not
# Kubernetes: a one-process run in a pod must stay one process.
_DETECTED = ("GceTpuCluster", "GkeTpuCluster", "SlurmCluster", "OmpiCluster")


def _cluster_detected() -> bool:
    """Whether JAX's automatic start-up finds a TPU pod slice, SLURM or Open MPI job."""
    from jax._src import clusters  # what jax.distributed.initialize() consults with no args

    return any(env.__name__ in _DETECTED and env.is_env_present()
               for env in clusters.ClusterEnv._cluster_types)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_primary() -> bool:
    """Whether this is process 0, the one that writes what a job writes once."""
    return jax.process_index() == 0


def check_same(what: str, data: bytes) -> None:
    """Raises a ValueError naming `what` and the processes unless every process passed the
    same `data` (e.g. a run's settings): a job whose processes were started with different
    options would otherwise compute nonsense or wait forever. Every process must call it."""
    if not is_multiprocess():
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(data).digest(), np.uint32)
    digests = multihost_utils.process_allgather(digest)  # [processes, 8]
    differ = [i for i, other in enumerate(digests) if not np.array_equal(other, digests[0])]
    if differ:
        raise ValueError(f"process {differ[0]} was started with other {what} than process 0: "
                         "start every process of the job with the same options and data")


def host_arrays(tree: Any) -> Any:
    """`tree` with every leaf a numpy array of all of it, also those whose shards are spread
    over processes: those are gathered in one compiled program that every process must run
    (call it from all of them, with the same tree). Other leaves are only copied to the host.
    """
    leaves, treedef = jax.tree.flatten(tree)
    spread = [i for i, leaf in enumerate(leaves)
              if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
              and not leaf.is_fully_replicated]
    if spread:
        meshes = {leaves[i].sharding.mesh for i in spread
                  if isinstance(leaves[i].sharding, NamedSharding)}
        if len(meshes) != 1 or any(not isinstance(leaves[i].sharding, NamedSharding)
                                   for i in spread):
            raise ValueError("host_arrays gathers arrays sharded over one mesh only")
        gathered = _replicate([leaves[i] for i in spread], meshes.pop())
        for i, leaf in zip(spread, gathered, strict=True):
            leaves[i] = leaf
    return jax.tree.unflatten(treedef, [_local_copy(leaf) for leaf in leaves])


@functools.partial(jax.jit, static_argnums=1)
def _replicate(arrays: list[jax.Array], mesh) -> list[jax.Array]:
    everywhere = NamedSharding(mesh, PartitionSpec())
    return [jax.lax.with_sharding_constraint(a, everywhere) for a in arrays]


def _local_copy(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(leaf.addressable_data(0))  # replicated: every shard is all of it
    return np.asarray(jax.device_get(leaf))
